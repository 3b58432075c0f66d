"""Preemption-safe training state (design §9): atomic, checksummed checkpoints and a stop flag set by the
signals schedulers send before killing a job.

    state = gpuops.TrainingState("ckpt", keep=3)
    resumed = state.load(model=model, optimizer=opt, scaler=scaler)      # None on a fresh start
    for step in range(resumed["step"] + 1 if resumed else 0, steps):
        ...
        if step % 100 == 0 or state.should_stop():
            state.save(step=step, model=model, optimizer=opt, scaler=scaler, data_position=loader_pos)
        if state.should_stop():
            break

Layout of the folder: ``state-<step>.pt`` files, ``manifest.json`` (every kept file with its size and
SHA-256, newest last) and ``LATEST`` (the newest file's name). A save writes the state to a temporary file
in the same folder, fsyncs it, renames it into place and fsyncs the folder, then replaces the manifest and
LATEST the same way, then deletes the states beyond ``keep``. A process killed at any moment therefore
leaves either the previous manifest or the new one, each naming only complete files. ``load`` checks size
and checksum, and falls back to the previous good state with a warning naming the bad file.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import threading
import warnings
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import torch

from ._snapshot import StateSnapshot

_STATE_NAME = re.compile(r"^state-(\d+)\.pt$")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, data: bytes) -> None:
    """Temp file in the same folder, fsync, rename over `path`, fsync the folder."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _rng_states() -> dict:
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy

        states["numpy"] = numpy.random.get_state()
    except ImportError:  # numpy is optional
        pass
    return states


def _restore_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states:
        import numpy

        numpy.random.set_state(states["numpy"])


class TrainingState:
    """Saves and loads model, optimizer, scaler, RNG states, step, epoch, data position and extras.

    ``keep``: how many states stay on disk. ``process_group``: a ``torch.distributed`` group (Gloo, NCCL);
    with it ``should_stop()`` is agreed by every rank, so no rank stops alone. ``signals``: caught while the
    object is open (SIGTERM and SIGUSR1 by default, as schedulers send them before a kill); they set the
    stop flag instead of killing the process. Use as a context manager, or call ``close()``, to restore
    the previous handlers.
    """

    def __init__(self, directory, keep: int = 3, *, process_group=None,
                 signals: Sequence[int] = (signal.SIGTERM, signal.SIGUSR1)) -> None:
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"TrainingState: keep must be an int >= 1, got {keep!r}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.process_group = process_group
        self._stop_requested = False
        self._previous_handlers: Dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():  # Python only allows handlers there
            for sig in signals:
                self._previous_handlers[sig] = signal.signal(sig, self._on_signal)

    # ------------------------------------------------------------------ signals
    def _on_signal(self, signum, frame) -> None:
        self._stop_requested = True

    def request_stop(self) -> None:
        """Sets the stop flag, as a caught signal does."""
        self._stop_requested = True

    def should_stop(self) -> bool:
        """True once a caught signal (on any rank, with a process group) asked the job to stop."""
        if self.process_group is None:
            return self._stop_requested
        import torch.distributed as dist

        backend = dist.get_backend(self.process_group)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        flag = torch.tensor([1 if self._stop_requested else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
        self._stop_requested = bool(flag.item())
        return self._stop_requested

    def close(self) -> None:
        """Restores the signal handlers that were there before."""
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers = {}

    def __enter__(self) -> "TrainingState":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ manifest
    def _manifest_path(self) -> Path:
        return self.directory / "manifest.json"

    def _read_manifest(self) -> Optional[list]:
        try:
            entries = json.loads(self._manifest_path().read_text())["states"]
            if not all({"file", "bytes", "sha256", "step"} <= set(e) for e in entries):
                raise ValueError("an entry lacks file, bytes, sha256 or step")
            return entries
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as e:
            warnings.warn(f"TrainingState: {self._manifest_path()} is unreadable ({e}); scanning {self.directory}")
            return None

    def _write_manifest(self, entries: list) -> None:
        _write_atomically(self._manifest_path(), json.dumps({"states": entries}, indent=1).encode())
        _write_atomically(self.directory / "LATEST", (entries[-1]["file"] + "\n").encode())

    # ------------------------------------------------------------------ save / load
    def save(self, *, step: int, model: Optional[torch.nn.Module] = None, optimizer=None, scaler=None,
             epoch: int = 0, data_position: Any = None, extras: Optional[dict] = None) -> Path:
        """Writes a complete state atomically; returns its path. Only rank 0 writes with a process group."""
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"TrainingState.save: step must be an int >= 0, got {step!r}")
        payload = {"format": 1, "step": step, "epoch": epoch, "data_position": data_position,
                   "extras": extras or {}, "rng": _rng_states(),
                   "model": model.state_dict() if model is not None else None,
                   "optimizer": optimizer.state_dict() if optimizer is not None else None,
                   "scaler": scaler.state_dict() if scaler is not None else None}
        path = self.directory / f"state-{step:012d}.pt"
        if self.process_group is not None:
            import torch.distributed as dist

            if dist.get_rank(self.process_group) != 0:
                dist.barrier(group=self.process_group)
                return path
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        entry = {"file": path.name, "bytes": tmp.stat().st_size, "sha256": _sha256(tmp), "step": step}
        os.replace(tmp, path)
        _fsync_dir(self.directory)
        entries = [e for e in (self._read_manifest() or []) if e["file"] != path.name] + [entry]
        entries.sort(key=lambda e: e["step"])
        kept = entries[-self.keep:]
        self._write_manifest(kept)
        self._remove_unlisted({e["file"] for e in kept})
        if self.process_group is not None:
            import torch.distributed as dist

            dist.barrier(group=self.process_group)
        return path

    def _remove_unlisted(self, kept: set) -> None:
        for file in self.directory.iterdir():
            stale_state = _STATE_NAME.match(file.name) and file.name not in kept
            stale_tmp = file.name.startswith(".") and ".tmp-" in file.name
            if stale_state or stale_tmp:
                file.unlink(missing_ok=True)

    def _candidates(self) -> list:
        """(path, expected bytes or None, sha256 or None), newest first."""
        entries = self._read_manifest()
        if entries is not None:
            return [(self.directory / e["file"], e["bytes"], e["sha256"]) for e in reversed(entries)]
        found = sorted((f for f in self.directory.iterdir() if _STATE_NAME.match(f.name)), reverse=True)
        return [(f, None, None) for f in found]

    def load(self, *, model: Optional[torch.nn.Module] = None, optimizer=None, scaler=None,
             map_location=None, restore_rng: bool = True) -> Optional[dict]:
        """Loads the newest good state into the given objects; returns {"step", "epoch", "data_position",
        "extras", "path"}, or None when the folder holds no state. A truncated or corrupt file is skipped with
        a warning naming it, and the previous good state is used."""
        for path, size, digest in self._candidates():
            problem = None
            if not path.exists():
                problem = "is missing"
            elif size is not None and path.stat().st_size != size:
                problem = f"has {path.stat().st_size} bytes, the manifest says {size} (truncated?)"
            elif digest is not None and _sha256(path) != digest:
                problem = "does not match its SHA-256 checksum (corrupt)"
            if problem is None:
                try:
                    payload = torch.load(path, map_location=map_location, weights_only=False)
                    if not isinstance(payload, dict) or payload.get("format") != 1:
                        raise ValueError("not a gpuops training state")
                except Exception as e:  # noqa: BLE001 - any unreadable file means: use the previous one
                    problem = f"cannot be read ({type(e).__name__}: {e})"
            if problem is not None:
                warnings.warn(f"TrainingState: {path} {problem}; trying the previous state")
                continue
            targets = [o for o in (model, optimizer, scaler) if o is not None]
            backup = StateSnapshot(targets)
            try:
                if model is not None:
                    model.load_state_dict(payload["model"])
                if optimizer is not None:
                    optimizer.load_state_dict(payload["optimizer"])
                if scaler is not None and payload["scaler"]:  # (a disabled scaler saved {})
                    scaler.load_state_dict(payload["scaler"])
            except Exception as e:  # noqa: BLE001 - whatever failed, the objects go back as they were
                backup.restore()
                raise ValueError(f"TrainingState.load: {path} does not fit the objects given ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0]}); nothing was changed") from e
            if restore_rng:
                _restore_rng_states(payload["rng"])
            return {"step": payload["step"], "epoch": payload["epoch"], "data_position": payload["data_position"],
                    "extras": payload["extras"], "path": path}
        return None
