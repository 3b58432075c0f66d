"""gpuops.TrainingState under faults and hostile folders (issue "Reliability"): kills while re-saving one
step, a lost or corrupt manifest, a manifest that points out of the folder, failed saves, states from
older versions, and state files that would run code when unpickled. The file protocol is the C++
StateStore, so these cases also cover gpuops::TrainingState (tests/cpp/test_training_state.cpp runs the
C++-specific ones)."""

import json
import os
import random
import signal
import time

import numpy
import pytest
import torch

import gpuops
from gpuops import _C


def filled(value, size=4, layers=1):
    model = torch.nn.Sequential(*(torch.nn.Linear(size, size) for _ in range(layers)))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(value))
    return model


def names(folder):
    return sorted(f.name for f in folder.iterdir() if f.name not in ("manifest.json", "LATEST"))


def test_sigkill_while_resaving_the_only_state_never_loses_it(tmp_path):
    """keep=1 and the same step saved again and again: the old state must outlive every kill."""
    rng = random.Random()
    for kill in range(20):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child never returns into pytest
            try:
                os.close(read_end)
                state = gpuops.TrainingState(tmp_path, keep=1, signals=())
                value = kill * 1000
                while True:
                    # Layers under torch's parallel grain: OpenMP's thread pool does not survive fork().
                    state.save(step=7, model=filled(value, 64, layers=24), extras={"value": value})
                    if value == kill * 1000:
                        os.write(write_end, b"x")  # a first save is complete
                    value += 1
            finally:
                os._exit(1)
        os.close(write_end)
        assert os.read(read_end, 1) == b"x"
        os.close(read_end)
        time.sleep(rng.uniform(0.0, 0.03))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        model = filled(0, 64, layers=24)
        info = gpuops.TrainingState(tmp_path, keep=1, signals=()).load(model=model, restore_rng=False)
        assert info is not None, f"kill {kill} lost the only state: {names(tmp_path)}"
        assert all(torch.all(p == info["extras"]["value"]) for p in model.parameters())


def test_a_corrupt_manifest_then_a_save_keeps_the_older_states(tmp_path):
    with gpuops.TrainingState(tmp_path, keep=3, signals=()) as state:
        for step in (1, 2, 3):
            state.save(step=step, model=filled(step))
        (tmp_path / "manifest.json").write_text('{"states": [{"file": 3}]}')
        with pytest.warns(UserWarning):
            state.save(step=4, model=filled(4))
        assert names(tmp_path) == ["state-000000000002", "state-000000000003", "state-000000000004"]
        manifest = json.loads((tmp_path / "manifest.json").read_text())
        assert [e["step"] for e in manifest["states"]] == [2, 3, 4]  # rebuilt from the folder, verified


def test_without_a_manifest_a_flipped_bit_is_still_caught(tmp_path):
    with gpuops.TrainingState(tmp_path, keep=3, signals=()) as state:
        for step in (1, 2):
            state.save(step=step, model=filled(step))
        (tmp_path / "manifest.json").unlink()
        newest = tmp_path / "state-000000000002" / "state.pt"
        data = bytearray(newest.read_bytes())
        data[len(data) // 2] ^= 0x01
        newest.write_bytes(bytes(data))
        model = filled(0)
        with pytest.warns(UserWarning, match="state-000000000002/state.pt does not match its SHA-256"):
            assert state.load(model=model)["step"] == 1
        assert torch.all(model[0].weight == 1)


def test_a_manifest_with_no_usable_entry_falls_back_to_the_folder_and_saves_delete_nothing_good(tmp_path):
    with gpuops.TrainingState(tmp_path, keep=2, signals=()) as state:
        for step in (1, 2):
            state.save(step=step, model=filled(step))
        (tmp_path / "manifest.json").write_text(json.dumps({"states": [
            {"file": "state-000000000099.pt", "bytes": 1, "sha256": "0" * 64, "step": 99}]}))
        with pytest.warns(UserWarning, match="state-000000000099.pt is missing"):
            assert state.load(model=filled(0))["step"] == 2
        state.save(step=3, model=filled(3))
        assert names(tmp_path) == ["state-000000000002", "state-000000000003"]


def test_manifest_entries_cannot_point_out_of_the_folder(tmp_path):
    outside = tmp_path / "secret"
    outside.write_bytes(b"not yours")
    folder = tmp_path / "states"
    with gpuops.TrainingState(folder, signals=()) as state:
        state.save(step=1, model=filled(1))
        os.mkfifo(folder / "state-000000000005.pt")  # a FIFO would hang a reader
        (folder / "state-000000000006").symlink_to(outside)
        sha = "a" * 64
        (folder / "manifest.json").write_text(json.dumps({"states": [
            {"file": "../secret", "bytes": 9, "sha256": sha, "step": 1},
            {"file": "/dev/zero", "bytes": 9, "sha256": sha, "step": 1},
            {"file": "state-000000000005.pt", "bytes": 9, "sha256": sha, "step": 5},
            {"name": "state-000000000007", "step": 7, "sequence": 0, "writer": "python",
             "files": [{"name": "../../secret", "bytes": 9, "sha256": sha}]}]}))
        start = time.monotonic()
        with pytest.warns(UserWarning) as caught:
            assert state.load(model=filled(0))["step"] == 1
        assert time.monotonic() - start < 30
        said = "\n".join(str(w.message) for w in caught)
        assert "is not the name of a state" in said and "is not a regular file" in said


def test_a_failed_save_leaves_no_temporary_and_changes_nothing(tmp_path, monkeypatch):
    with gpuops.TrainingState(tmp_path, keep=2, signals=()) as state:
        state.save(step=1, model=filled(1))
        before = (tmp_path / "manifest.json").read_text()

        def half_then_fail(obj, f, *args, **kwargs):
            with open(f, "wb") as out:
                out.write(b"half a state")
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(torch, "save", half_then_fail)
        with pytest.raises(OSError, match="No space left"):
            state.save(step=2, model=filled(2))
        monkeypatch.undo()
        assert names(tmp_path) == ["state-000000000001"]
        assert (tmp_path / "manifest.json").read_text() == before


def test_a_folder_that_cannot_be_made_is_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=str(blocker)):
        gpuops.TrainingState(blocker / "states")


@pytest.mark.parametrize("bad", [lambda: None, object(), numpy.zeros(3), {1, 2}, torch.nn.Linear(1, 1)])
def test_save_refuses_extras_that_could_not_load_without_running_code(tmp_path, bad):
    with gpuops.TrainingState(tmp_path, signals=()) as state:
        with pytest.raises(TypeError, match=r"extras\['x'\]\[1\] is a .*weights_only=True"):
            state.save(step=1, extras={"x": [1, bad]})
        with pytest.raises(TypeError, match="data_position is a"):
            state.save(step=1, data_position=bad)
        assert names(tmp_path) == []


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def _plant(folder, step, payload):
    """Commits an arbitrary pickle as a state through the engine, checksums and all (what an attacker who
    writes the folder can do)."""
    store = _C.StateStore(str(folder), 3)
    pending = store.begin(step, ["state.pt"], "python")
    torch.save(payload, pending.file_path("state.pt"))
    store.commit(pending)  # (returns the state and any warnings)


def test_a_state_file_carrying_a_pickled_callable_is_refused(tmp_path, monkeypatch):
    calls = []
    with gpuops.TrainingState(tmp_path, signals=()) as state:
        good = state.save(step=1, model=filled(1))
        payload = torch.load(good / "state.pt", weights_only=True)
        _plant(tmp_path, 2, dict(payload, step=2, extras={"x": _Boom()}))
        monkeypatch.setattr(os, "system", lambda *a: calls.append(a))  # (after pickling os.system by name)
        model = filled(0)
        with pytest.warns(UserWarning, match="state-000000000002/state.pt is refused: .*weights_only=True"):
            assert state.load(model=model)["step"] == 1  # the previous good state
        (good / "state.pt").unlink()
        with pytest.raises(RuntimeError, match="none can be loaded(.|\n)*is refused"):
            with pytest.warns(UserWarning):
                state.load(model=model)
    assert calls == []  # nothing ran


def test_a_state_written_by_the_previous_format_still_loads(tmp_path):
    """gpuops 0.1 wrote state-<step>.pt pickles (numpy's RNG state as an array) listed in a manifest."""
    import hashlib

    numpy.random.seed(5)
    expected_numpy = numpy.random.get_state()
    model = filled(3)
    payload = {"format": 1, "step": 3, "epoch": 1, "data_position": 12, "extras": {"k": "v"},
               "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": expected_numpy},
               "model": model.state_dict(), "optimizer": None, "scaler": None}
    path = tmp_path / "state-000000000003.pt"
    torch.save(payload, path)
    data = path.read_bytes()
    (tmp_path / "manifest.json").write_text(json.dumps({"states": [
        {"file": path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "step": 3}]}))
    (tmp_path / "LATEST").write_text(path.name + "\n")
    numpy.random.seed(99)
    loaded = filled(0)
    with gpuops.TrainingState(tmp_path, keep=2, signals=()) as state:
        info = state.load(model=loaded)
        assert (info["step"], info["data_position"], info["extras"]) == (3, 12, {"k": "v"})
        assert torch.all(loaded[0].weight == 3)
        assert numpy.array_equal(numpy.random.get_state()[1], expected_numpy[1])
        state.save(step=4, model=loaded)  # the new format beside the old; keep=2 keeps both
        assert names(tmp_path) == ["state-000000000003.pt", "state-000000000004"]
        assert state.load(model=loaded)["step"] == 4


def test_numpy_and_python_random_streams_resume(tmp_path):
    with gpuops.TrainingState(tmp_path, signals=()) as state:
        numpy.random.seed(1)
        random.seed(2)
        state.save(step=1)
        expected = (numpy.random.rand(3).tolist(), random.random())
        numpy.random.seed(7)
        random.seed(8)
        state.load()
        assert (numpy.random.rand(3).tolist(), random.random()) == expected


@pytest.mark.parametrize("keep", [0, -1, 1.5, True, "3", None])
def test_bad_keep_is_refused(tmp_path, keep):
    with pytest.raises(ValueError, match="keep must be an int >= 1"):
        gpuops.TrainingState(tmp_path, keep=keep)


@pytest.mark.parametrize("step", [-1, 1.0, True, "1", None, 10**18])
def test_bad_step_is_refused(tmp_path, step):
    with gpuops.TrainingState(tmp_path, signals=()) as state:
        with pytest.raises(ValueError, match="step must be an int"):
            state.save(step=step)
        assert names(tmp_path) == []


def test_plain_extras_round_trip(tmp_path):
    extras = {"ints": (1, -2, 2**40), "float": 0.5, "none": None, "text": "é", "nested": {"t": torch.arange(3)},
              "size": torch.Size([2, 3]), "dtype": torch.bfloat16, "device": torch.device("cpu"), 3: [True]}
    with gpuops.TrainingState(tmp_path, signals=()) as state:
        state.save(step=1, extras=extras, data_position={"epoch_order": [3, 1, 2]})
        info = state.load()
    assert info["data_position"] == {"epoch_order": [3, 1, 2]}
    got = info["extras"]
    assert torch.equal(got.pop("nested")["t"], torch.arange(3))
    assert got == {k: v for k, v in extras.items() if k != "nested"}


@pytest.mark.parametrize("bad", [signal.SIGKILL, 0, 999, "SIGTERM", 1.5])
def test_bad_signals_are_refused_and_no_handler_stays_installed(tmp_path, bad):
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(ValueError, match="signals has .* that can be caught"):
        gpuops.TrainingState(tmp_path, signals=(signal.SIGUSR1, bad))
    assert signal.getsignal(signal.SIGUSR1) is before


@pytest.mark.parametrize("name", ["model", "optimizer", "scaler"])
def test_objects_without_state_dicts_are_named(tmp_path, name):
    with gpuops.TrainingState(tmp_path, signals=()) as state:
        with pytest.raises(TypeError, match=f"{name} must have state_dict"):
            state.save(step=1, **{name: torch.zeros(2)})
        with pytest.raises(TypeError, match=f"{name} must have state_dict"):
            state.load(**{name: [1, 2]})
        assert names(tmp_path) == []


def test_two_open_states_both_hear_a_signal_and_closing_one_keeps_the_other_listening(tmp_path):
    before = signal.getsignal(signal.SIGUSR1)
    a = gpuops.TrainingState(tmp_path / "a", signals=(signal.SIGUSR1, signal.SIGUSR1))
    b = gpuops.TrainingState(tmp_path / "b", signals=(signal.SIGUSR1,))
    os.kill(os.getpid(), signal.SIGUSR1)
    assert a.should_stop() and b.should_stop()
    a.close()
    c = gpuops.TrainingState(tmp_path / "c", signals=(signal.SIGUSR1,))
    os.kill(os.getpid(), signal.SIGUSR1)  # would kill the process if closing a had uninstalled the handler
    assert c.should_stop()
    b.close()
    c.close()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_bad_constructor_and_load_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="directory must be a non-empty path"):
        gpuops.TrainingState("")
    with pytest.raises(TypeError, match="signals must be a sequence"):
        gpuops.TrainingState(tmp_path, signals=None)
    with pytest.raises(TypeError, match="process_group must be a torch.distributed ProcessGroup"):
        gpuops.TrainingState(tmp_path, process_group="x")
    with gpuops.TrainingState(tmp_path, signals=()) as state:
        state.save(step=1)
        with pytest.raises(ValueError, match="map_location 'tpu' is not a usable device"):
            state.load(map_location="tpu")
