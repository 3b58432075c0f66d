"""python -m gpuops.metrics plot run/metrics.jsonl -o run.png (docs/telemetry.md)."""

import argparse
import os

from .plot import plot


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuops.metrics", description="Training telemetry files.")
    commands = parser.add_subparsers(dest="command", required=True)
    drawing = commands.add_parser("plot", help="draw a run's records (loss, loss scale, grad norm, tokens/s, "
                                  "memory) as a PNG")
    drawing.add_argument("records", help="the JSON Lines file a Recorder wrote")
    drawing.add_argument("-o", "--out", default=None, help="the picture (default: <records>.png)")
    args = parser.parse_args(argv)
    try:
        out = plot(args.records, args.out or os.path.splitext(args.records)[0] + ".png")
    except (OSError, ValueError) as e:
        parser.exit(2, f"gpuops.metrics plot: {e}\n")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
