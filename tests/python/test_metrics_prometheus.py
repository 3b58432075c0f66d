"""The telemetry's Prometheus endpoint: Prometheus' own text parser reads real HTTP scrapes of a training run
(localhost only), twice, with the step advancing; the endpoint binds the one address it is given; a port in use,
an address not of this host and a port out of range are refused at creation, leaving no file behind. Hostile
clients (another local process, on loopback only) cost the training process a bounded number of file handles
and no memory, never hold a scrape or close(): a large POST body, a thousand idle connections, slow drips."""

import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request

import pytest

import gpuops
from test_metrics import _run

parser = pytest.importorskip("prometheus_client.parser")  # (requirements/build.txt; the GPU machine lacks them)
psutil = pytest.importorskip("psutil")
pytestmark = pytest.mark.skipif(not gpuops.metrics.prometheus_available(),
                                reason="this build of gpuops has no Prometheus endpoint")


def _scrape(port):
    """{metric name: (labels, value)} of one scrape, parsed by prometheus_client."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    return {s.name: (s.labels, s.value) for family in parser.text_string_to_metric_families(text)
            for s in family.samples if s.name != "gpuops_lr"}, text


def test_two_scrapes_during_training_read_each_record(tmp_path):
    records = []
    recorder = gpuops.metrics.Recorder(log_every=3, jsonl=tmp_path / "m.jsonl", prometheus_port=0, job="finetune",
                                       callback=records.append)
    port = recorder.prometheus_port
    assert isinstance(port, int) and port > 0
    assert _scrape(port)[0] == {}  # nothing recorded yet: no figure is made up
    scrapes = []
    for _ in range(2):
        _run(recorder, 3)  # one record each
        scrapes.append(_scrape(port))
    recorder.close()
    for (samples, text), record in zip(scrapes, records):
        labels, step = samples["gpuops_step"]
        assert labels == {"job": "finetune", "rank": "0", "world_size": "1"}
        assert step == record["step"]
        for name in ("loss", "grad_norm", "loss_scale", "skipped_steps", "tokens_per_s"):
            assert samples[f"gpuops_{name}"][1] == pytest.approx(record[name], rel=1e-12), name
        assert samples["gpuops_step_time_seconds"][1] == pytest.approx(record["step_time_s"], rel=1e-12)
        assert samples["gpuops_last_step_timestamp_seconds"][1] == pytest.approx(record["time"], rel=1e-12)
        assert "gpuops_peak_allocated_bytes" not in samples  # not reported on the CPU: left out, not 0
        assert f'gpuops_lr{{job="finetune",rank="0",world_size="1",group="1"}} {record["lr"][1]}' in text
    assert [s[0]["gpuops_step"][1] for s in scrapes] == [3, 6]
    assert scrapes[1][0]["gpuops_last_step_timestamp_seconds"][1] > scrapes[0][0]["gpuops_last_step_timestamp_seconds"][1]
    with pytest.raises(urllib.error.URLError):  # closed: the port is free again
        _scrape(port)


def test_the_endpoint_binds_only_the_address_it_is_given():
    with gpuops.metrics.Recorder(prometheus_port=0) as recorder:
        listening = [c.laddr for c in psutil.net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == recorder.prometheus_port]
        assert [address.ip for address in listening] == ["127.0.0.1"]


def test_each_rank_serves_on_its_own_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        base = probe.getsockname()[1]
    with gpuops.metrics.Recorder(rank=1, world_size=2, prometheus_port=base) as recorder:
        assert recorder.prometheus_port == base + 1
        recorder.step_done(1.5)
        recorder.flush()
        assert _scrape(base + 1)[0]["gpuops_step"][0]["rank"] == "1"


def test_a_port_in_use_is_refused_and_leaves_no_file(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"127.0.0.1:{port} cannot be bound"):
            gpuops.metrics.Recorder(jsonl=tmp_path / "m.jsonl", prometheus_port=port)
    assert not (tmp_path / "m.jsonl").exists()


@pytest.mark.parametrize("address", ["203.0.113.7", "not an address"])
def test_an_address_not_of_this_host_is_refused(address):
    with pytest.raises(ValueError, match="cannot be bound"):
        gpuops.metrics.Recorder(prometheus_port=0, prometheus_address=address)


@pytest.mark.parametrize("port", [-2, 65536, 70000])
def test_a_port_out_of_range_is_refused(port):
    with pytest.raises(ValueError, match="prometheus_port"):
        gpuops.metrics.Recorder(prometheus_port=port)


def test_a_second_endpoint_on_a_port_in_use_is_refused():
    """SO_REUSEPORT would let the second bind succeed silently; the endpoint sets SO_REUSEADDR only."""
    with gpuops.metrics.Recorder(prometheus_port=0) as first:
        with pytest.raises(ValueError, match="cannot be bound"):
            gpuops.metrics.Recorder(prometheus_port=first.prometheus_port)


def test_label_values_are_escaped():
    job = 'a "quoted" job\\with\nnewline'
    with gpuops.metrics.Recorder(log_every=1, prometheus_port=0, job=job) as recorder:
        recorder.step_done(1.0)
        samples, text = _scrape(recorder.prometheus_port)
    assert samples["gpuops_step"][0]["job"] == job
    assert text.count("# TYPE gpuops_step gauge") == 1


def test_checkpoint_saves_are_process_totals(tmp_path):
    import torch
    before = None
    with gpuops.metrics.Recorder(log_every=1, prometheus_port=0) as recorder:
        recorder.step_done(1.0)
        before, _ = _scrape(recorder.prometheus_port)
        with gpuops.TrainingState(tmp_path) as state:
            state.save(step=1, model=torch.nn.Linear(4, 4))
        recorder.step_done(2.0)
        after, text = _scrape(recorder.prometheus_port)
    assert "# TYPE gpuops_checkpoint_saves_total counter" in text
    assert after["gpuops_checkpoint_saves_total"][1] == before["gpuops_checkpoint_saves_total"][1] + 1
    assert after["gpuops_checkpoint_bytes_total"][1] > before["gpuops_checkpoint_bytes_total"][1]


def _request(port, raw: bytes, timeout=10) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(raw)
        sock.shutdown(socket.SHUT_WR)
        return b"".join(iter(lambda: sock.recv(65536), b""))


def test_only_get_and_head_of_metrics_are_served_and_the_head_is_bounded():
    with gpuops.metrics.Recorder(log_every=1, prometheus_port=0) as recorder:
        recorder.step_done(1.0)
        port = recorder.prometheus_port
        get = _request(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        head = _request(port, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert get.startswith(b"HTTP/1.1 200 OK") and b"gpuops_step{" in get
        length = [line for line in get.split(b"\r\n") if line.startswith(b"Content-Length:")]
        assert head.startswith(b"HTTP/1.1 200 OK") and head.endswith(b"\r\n\r\n") and length[0] in head  # no body
        assert _request(port, b"PUT /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 405")
        assert _request(port, b"GET /admin HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 404")
        assert _request(port, b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 9000).startswith(b"HTTP/1.1 431")


_ATTACKER = textwrap.dedent("""
    import socket, sys, time
    port, kind, seconds = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    held = []
    if kind == "post":  # a body that never ends: the endpoint must not read it into memory
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /metrics HTTP/1.1\\r\\nContent-Length: 2000000000\\r\\n\\r\\n")
        block, end = b"x" * (1 << 20), time.monotonic() + seconds
        try:
            while time.monotonic() < end:
                s.sendall(block)
        except OSError:
            pass
    elif kind == "idle":  # connections opened and never written to
        for _ in range(1000):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            held.append(s)
        print("connected", flush=True)
        time.sleep(seconds)
    else:  # slow drips: a byte of a request head every 0.2 s
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        print("connected", flush=True)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for s in held:
                try:
                    s.send(b"G")
                except OSError:
                    pass
            time.sleep(0.2)
""")


def _attack(port, kind, seconds):
    return subprocess.Popen([sys.executable, "-c", _ATTACKER, str(port), kind, str(seconds)], stdout=subprocess.PIPE,
                            text=True)


def _open_sockets():
    """This process's sockets (the test's own pipes to the attacker are not the endpoint's)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # closed meanwhile
            pass
    return count


def _rss():
    return psutil.Process().memory_info().rss


def test_a_large_post_body_is_never_kept():
    with gpuops.metrics.Recorder(log_every=1, prometheus_port=0) as recorder:
        recorder.step_done(1.0)
        before = _rss()
        attacker = _attack(recorder.prometheus_port, "post", 3)
        attacker.wait(30)
        assert _rss() - before < 32 << 20  # the earlier server kept what was sent (+1.5 GB for 1.5 GB)
        assert _scrape(recorder.prometheus_port)[0]["gpuops_step"][1] == 1


def test_a_thousand_idle_connections_cost_a_bounded_number_of_file_handles_and_close_returns():
    recorder = gpuops.metrics.Recorder(log_every=1, prometheus_port=0)
    recorder.step_done(1.0)
    before = _open_sockets()
    attacker = _attack(recorder.prometheus_port, "idle", 20)
    assert attacker.stdout.readline().strip() == "connected"
    time.sleep(1.0)
    grown = _open_sockets() - before
    with open(os.devnull) as f:  # the training's next open() works
        assert f.fileno() > 0
    start = time.monotonic()
    recorder.close()
    took = time.monotonic() - start
    attacker.kill()
    attacker.wait(10)
    assert grown <= 16, f"{grown} sockets held for idle connections"  # at most 16 connections at once
    assert took < 1.0, f"close() took {took:.2f} s with idle clients"


def test_slow_drips_neither_block_a_scrape_nor_hold_close():
    recorder = gpuops.metrics.Recorder(log_every=1, prometheus_port=0)
    recorder.step_done(1.0)
    attacker = _attack(recorder.prometheus_port, "drip", 20)
    assert attacker.stdout.readline().strip() == "connected"
    start = time.monotonic()
    assert _scrape(recorder.prometheus_port)[0]["gpuops_step"][1] == 1
    scraped = time.monotonic() - start
    start = time.monotonic()
    recorder.close()
    closed = time.monotonic() - start
    attacker.kill()
    attacker.wait(10)
    assert scraped < 2.0 and closed < 1.0, (scraped, closed)
