"""Preemption-safe training state: atomic, checksummed checkpoints and a stop flag set by the
signals schedulers send before killing a job.

    state = gpuops.TrainingState("ckpt", keep=3)
    resumed = state.load(model=model, optimizer=opt, scaler=scaler)      # None on a fresh start
    for step in range(resumed["step"] if resumed else 0, steps):   # a state's step: the steps done
        ...
        if (step + 1) % 100 == 0 or state.should_stop():
            state.save(step=step + 1, model=model, optimizer=opt, scaler=scaler, data_position=loader_pos)
        if state.should_stop():
            break

Files: one engine, ``gpuops._C.StateStore`` (the C++ ``gpuops::StateStore``, shared with the C++
``TrainingState``). Each save is a folder ``state-<step>`` holding ``state.pt`` and ``checksums.json`` (size
and SHA-256 of its files, kept with them), renamed into place only once complete; ``manifest.json`` and
``LATEST`` index the kept states, and ``keep`` removes older ones only after the new one is durable. A
process killed at any moment leaves every state that was complete before. ``load`` checks sizes and
checksums, finds states the manifest misses by scanning the folder, falls back to the previous good state
with a warning naming the bad one, and reads with ``torch.load(weights_only=True)``: a state file runs no
code, so a state folder from elsewhere is safe to load. Therefore ``data_position`` and ``extras`` hold
tensors, numbers, strings, None and dicts, lists and tuples of them (checked at save time).
"""

from __future__ import annotations

import functools
import os
import random
import signal
import threading
import warnings
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import torch

from . import _C
from . import dist as _dist
from ._snapshot import StateSnapshot

_STATE_FILE = "state.pt"
_FORMAT = 2  # 1: pickled by gpuops <= 0.1 (numpy arrays inside); 2: plain data and tensors only
_PLAIN = (type(None), bool, int, float, str, torch.Tensor, torch.Size, torch.dtype, torch.device)


def _check_plain(value, where: str) -> None:
    """Refuses what ``torch.load(weights_only=True)`` would refuse, naming where it is, at save time."""
    if isinstance(value, dict):
        for key, item in value.items():
            _check_plain(key, f"{where} key {key!r}")
            _check_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
    elif not isinstance(value, _PLAIN) or (isinstance(value, torch.Tensor) and type(value) is not torch.Tensor
                                           and not isinstance(value, torch.nn.Parameter)):
        raise TypeError(f"TrainingState.save: {where} is a {type(value).__module__}.{type(value).__qualname__}; a "
                        "state holds only tensors, numbers, strings, None and dicts, lists and tuples of them, "
                        "because it is loaded with torch.load(weights_only=True), which runs no code")


# Signals are process-wide, TrainingStates are not: one handler per signal while any open object listens
# (the handler found first comes back when the last one closes), and a signal reaches every listener.
_listeners: Dict[int, list] = {}
_original_handlers: Dict[int, Any] = {}


def _on_any_signal(signum, frame) -> None:
    for state in _listeners.get(signum, ()):
        state._stop_requested = True


def _listen(sig: int, state) -> None:
    if not _listeners.get(sig):
        _original_handlers[sig] = signal.signal(sig, _on_any_signal)
        _listeners[sig] = []
    _listeners[sig].append(state)


def _unlisten(sig: int, state) -> None:
    listening = _listeners.get(sig, [])
    if state in listening:
        listening.remove(state)
        if not listening:
            signal.signal(sig, _original_handlers.pop(sig))


def _check_objects(**objects) -> None:
    for name, obj in objects.items():
        if obj is not None and not (callable(getattr(obj, "state_dict", None))
                                    and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"TrainingState: {name} must have state_dict() and load_state_dict() (a module, an "
                            f"optimizer, a GradScaler) or be None, got {type(obj).__name__}")


def _rng_states() -> dict:
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy

        kind, key, pos, has_gauss, cached = numpy.random.get_state()
        states["numpy"] = {"kind": kind, "key": torch.from_numpy(key.astype("int64")), "pos": int(pos),
                           "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
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

        saved = states["numpy"]
        if isinstance(saved, dict):
            key = saved["key"].numpy().astype(numpy.uint32)
            saved = (saved["kind"], key, saved["pos"], saved["has_gauss"], saved["cached_gaussian"])
        numpy.random.set_state(saved)


def _quiet_sharded_model(method):
    """Inside save/load a stage-3 model's state_dict() leaves the sharded parameters out as it should (they go
    with the optimizer's shard files): the warning model.state_dict() gives a user who saves the model by hand
    stays quiet here."""

    @functools.wraps(method)
    def quiet(self, *args, **kwargs):
        optimizer = kwargs.get("optimizer")
        if not _is_sharded(optimizer):
            return method(self, *args, **kwargs)
        previous = getattr(optimizer, "_quiet_state_dict", False)
        optimizer._quiet_state_dict = True
        try:
            return method(self, *args, **kwargs)
        finally:
            optimizer._quiet_state_dict = previous

    return quiet


class TrainingState:
    """Saves and loads model, optimizer, scaler, LR scheduler, RNG states, step, epoch, data position and extras.

    ``keep``: how many states stay on disk. ``process_group``: a ``torch.distributed`` group (Gloo, NCCL);
    with it ``should_stop()`` is agreed by every rank, so no rank stops alone. ``signals``: caught while the
    object is open (SIGTERM and SIGUSR1 by default, as schedulers send them before a kill); they set the
    stop flag instead of killing the process. Use as a context manager, or call ``close()``, to restore
    the previous handlers.
    """

    def __init__(self, directory, keep: int = 3, *, process_group=None,
                 signals: Sequence[int] = (signal.SIGTERM, signal.SIGUSR1)) -> None:
        if not isinstance(keep, int) or isinstance(keep, bool) or not 1 <= keep < 2**63:
            raise ValueError(f"TrainingState: keep must be an int >= 1, got {keep!r}")
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
            raise ValueError(f"TrainingState: directory must be a non-empty path, got {directory!r}")
        if process_group is not None:
            import torch.distributed as dist

            if not isinstance(process_group, dist.ProcessGroup):
                raise TypeError("TrainingState: process_group must be a torch.distributed ProcessGroup or None, "
                                f"got {type(process_group).__name__}")
        if isinstance(signals, (str, bytes)) or not hasattr(signals, "__iter__"):
            raise TypeError(f"TrainingState: signals must be a sequence of signal numbers, got {signals!r}")
        self.directory = Path(directory)
        self._store = _C.StateStore(os.fspath(self.directory), keep)  # creates the folder (errors name it)
        self.keep = keep
        self.process_group = process_group
        self._stop_requested = False
        self._listening: Dict[int, bool] = {}
        signals = list(signals)
        valid = signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}
        for sig in signals:
            if isinstance(sig, bool) or not isinstance(sig, int) or sig not in valid:
                raise ValueError(f"TrainingState: signals has {sig!r}, which is not a signal that can be caught")
        if threading.current_thread() is threading.main_thread():  # Python only allows handlers there
            for sig in dict.fromkeys(signals):  # each once
                _listen(sig, self)
                self._listening[sig] = True

    # ------------------------------------------------------------------ signals
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
        """Stops listening; the handlers that were there before come back once no TrainingState listens."""
        for sig in self._listening:
            _unlisten(sig, self)
        self._listening = {}

    def __enter__(self) -> "TrainingState":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ save / load
    @_quiet_sharded_model
    def save(self, *, step: int, model: Optional[torch.nn.Module] = None, optimizer=None, scaler=None,
             epoch: int = 0, data_position: Any = None, extras: Optional[dict] = None, scheduler=None) -> Path:
        """Writes a complete state atomically; returns its folder. A failed save leaves nothing behind.
        ``step``: the optimizer steps done (the next step's index; the examples and docs use this meaning), which
        ``load`` returns and the telemetry's ``start_step`` takes.
        ``scheduler``: an LR scheduler (torch's, or anything with state_dict/load_state_dict), saved beside
        the optimizer as Lightning's and DeepSpeed's checkpoints hold it.
        With a process group only rank 0 writes; with a gpuops.ZeroOptimizer every rank writes its shard into the
        same state. With several ranks every rank's checks, ``step``, folder, ``keep`` and model layout are
        agreed first, and a failure on any rank raises on every rank, naming it (gpuops/sharded_state.h); each
        rank's RNG states, ``data_position`` and ``extras`` are saved as its own."""
        sharded = _is_sharded(optimizer)
        failure = payload = None
        try:
            payload = self._payload(step, model, optimizer, scaler, epoch, data_position, extras, scheduler)
        except Exception as error:  # noqa: BLE001 - with several ranks, raised after every rank heard of it
            failure = error
        comm = optimizer.communicator if sharded else self._communicator()
        if comm is None:
            if failure is not None:
                raise failure
            return Path(self._write(step, payload))
        fields, own = [], b""  # what the ranks must share; what each keeps of its own (gpuops/sharded_state.h)
        if failure is None:
            try:
                fields, own = self._shared_fields(model, optimizer), _own_part(payload)
            except Exception as error:  # noqa: BLE001 - as above
                failure = error
        agreed_step = step if failure is None else 0  # a failing rank's fields are not compared
        try:
            if sharded:
                # One file per rank in the same state (gpuops::save_sharded_state, shared with C++); state.pt
                # (rank 0's) holds the rest, with every rank's own part.
                return Path(_C.save_sharded_state(self._store, agreed_step, "python", optimizer._impl,
                                                  lambda file, parts: torch.save(_with_parts(payload, parts), file),
                                                  _first_line(failure), fields, own))
            return Path(_C.save_by_rank_zero(comm, agreed_step, _first_line(failure),
                                             lambda parts: self._write(step, _with_parts(payload, parts)),
                                             fields, own))
        except Exception:
            if failure is not None:
                raise failure from None  # this rank's own error, as it was raised
            raise

    def _payload(self, step, model, optimizer, scaler, epoch, data_position, extras, scheduler) -> dict:
        """What state.pt holds, every argument checked."""
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 10**18:
            raise ValueError(f"TrainingState.save: step must be an int in [0, 1e18), got {step!r}")
        if not isinstance(epoch, int) or isinstance(epoch, bool):
            raise TypeError(f"TrainingState.save: epoch must be an int, got {epoch!r}")
        if extras is not None and not isinstance(extras, dict):
            raise TypeError(f"TrainingState.save: extras must be a dict, got {type(extras).__name__}")
        _check_objects(model=model, optimizer=optimizer, scaler=scaler, scheduler=scheduler)
        sharded = _is_sharded(optimizer)
        if sharded:
            optimizer.wait_for_parameters()  # overlap_param_gather: the model is saved as the step left it
            optimizer._sync_options()
        _check_plain(data_position, "data_position")
        _check_plain(extras or {}, "extras")
        payload = {"format": _FORMAT, "step": step, "epoch": epoch, "data_position": data_position,
                   "extras": extras or {}, "rng": _rng_states(),
                   "model": model.state_dict() if model is not None else None,
                   "optimizer": optimizer.state_dict() if optimizer is not None and not sharded else None,
                   "scaler": scaler.state_dict() if scaler is not None else None,
                   "scheduler": scheduler.state_dict() if scheduler is not None else None}
        _check_plain(payload, "the state")  # optimizers' and scalers' state dicts, as a last guard
        if sharded:
            payload["sharded_optimizer"] = optimizer.kind
            # Stage 3: each state_dict key the model left out, and its parameter's name in the shard files (tied
            # parameters under each of their keys), so that an export without the model names them all.
            names = optimizer.param_names
            payload["sharded_names"] = ({key: names[i] for key, i in optimizer._sharded_names.items()}
                                        if names and optimizer._sharded_names else {})
        return payload

    def _shared_fields(self, model, optimizer) -> list:
        """What the ranks of a collective save or load must share besides the step: the folder (a rank that
        writes its shard or reads elsewhere), keep, the kind of optimizer (a ZeroOptimizer on some ranks only
        makes the ranks run different protocols) and the model's layout (names, shapes, dtypes)."""
        kind = "none" if optimizer is None else "sharded" if _is_sharded(optimizer) else "unsharded"
        layout = "none"
        if model is not None:
            tensors = list(model.named_parameters()) + list(model.named_buffers())
            layout = ";".join(f"{n}{tuple(t.shape)}{t.dtype}" for n, t in tensors)
        return [("folder", os.path.abspath(self.directory)), ("keep", str(self.keep)), ("optimizer", kind),
                ("model layout", layout)]

    def _write(self, step: int, payload: dict) -> str:
        """One state of this process (rank 0's with a group): the folder, or nothing on failure."""
        pending = self._store.begin(step, [_STATE_FILE], "python")
        try:
            torch.save(payload, pending.file_path(_STATE_FILE))
            stored, notes = self._store.commit(pending)
        except BaseException:
            self._store.abort(pending)
            raise
        for note in notes:
            warnings.warn(f"TrainingState: {note}")
        return stored.path

    def _communicator(self):
        """The agreements' communicator over process_group, or None without one."""
        if self.process_group is None:
            return None
        if getattr(self, "_comm", None) is None:
            from .dist import Communicator

            self._comm = Communicator(self.process_group)
        return self._comm

    @_quiet_sharded_model
    def load(self, *, model: Optional[torch.nn.Module] = None, optimizer=None, scaler=None,
             map_location=None, restore_rng: bool = True, allow_reshard: bool = False,
             scheduler=None) -> Optional[dict]:
        """Loads the newest good state into the given objects; returns {"step", "epoch", "data_position",
        "extras", "path", "ranks"}, or None when the folder holds no state. A truncated, corrupt or unsafe state is
        skipped with a warning naming it, and the previous good state is used; when states exist but none
        can be used, RuntimeError lists each one's problem (nothing is changed).

        With several ranks (a process group, or a gpuops.ZeroOptimizer) the ranks first agree on the state to
        load (folder copies whose newest states differ, or a rank that sees none, raise on every rank), then
        each loads its part and they agree that all did: all or nothing on every rank. With a ZeroOptimizer every
        rank loads its shard from the per-rank files; a state saved by another world size is resharded exactly
        when ``allow_reshard``, refused otherwise. With several ranks each rank gets back the RNG states,
        ``data_position`` and ``extras`` it saved ("ranks" lists every saving rank's data_position and extras, to
        map positions when the world size changed; a rank the saving job did not have takes rank 0's, with a
        warning), and the ranks must agree on the folder, ``keep`` and the model's layout. ``scheduler``: loaded
        from what save(scheduler=) wrote (a state saved without one does not fit: refused, nothing changed)."""
        sharded = _is_sharded(optimizer)
        comm = optimizer.communicator if sharded else self._communicator()
        stored = payload = failure = None
        try:
            _check_objects(model=model, optimizer=optimizer, scaler=scaler, scheduler=scheduler)
            _check_map_location(map_location)
            stored, payload = self._newest_good(map_location)
        except Exception as error:  # noqa: BLE001 - with several ranks, raised after every rank heard of it
            failure = error
        if comm is not None:
            try:
                fields = self._shared_fields(model, optimizer) if failure is None else []
                _C.agree_on_state(comm, _C.state_identity(stored), _first_line(failure), fields)
            except Exception:
                if failure is not None:
                    raise failure from None
                raise
        elif failure is not None:
            raise failure
        if stored is None:
            return None
        if comm is not None:
            payload = _own_of(payload, comm.rank, stored.path)
        if payload.get("sharded_names") and not sharded and model is not None:
            error = ValueError(f"TrainingState.load: {stored.path} was saved by a gpuops.ZeroOptimizer at stage 3: "
                               "its model's parameters are in the shard files; load it with that optimizer "
                               "(optimizer=), or export a plain state_dict: python -m gpuops.state export "
                               f"{self.directory} model.pt")
            if comm is not None:
                _dist.fail_together(comm, "TrainingState.load", error)
            raise error
        if sharded:
            self._apply_sharded(stored, payload, model, optimizer, scaler, allow_reshard, restore_rng, scheduler)
        else:
            self._apply(Path(stored.path), payload, model, optimizer, scaler, restore_rng, comm, scheduler)
        ranks = [{"data_position": p["data_position"], "extras": p["extras"]} for p in payload.get("ranks") or []]
        return {"step": payload["step"], "epoch": payload["epoch"], "data_position": payload["data_position"],
                "extras": payload["extras"], "path": Path(stored.path), "ranks": ranks}

    def _newest_good(self, map_location):
        """(stored state, payload) of the newest state that verifies and reads, or (None, None) for an empty
        folder; RuntimeError listing each state's problem when states exist and none can be used."""
        states, notes = self._store.states()
        for note in notes:
            warnings.warn(f"TrainingState: {note}")
        problems = []
        for stored in states:
            problem, unverified = self._store.verify(stored)
            if not problem and not stored.legacy and stored.writer != "python":
                problem = (f"{stored.path} was written by the {stored.writer} TrainingState (a state is resumed "
                           "by the language that wrote it)")
            payload = None
            if not problem:
                if unverified:
                    warnings.warn(f"TrainingState: {stored.path} has no checksum (no manifest lists it); "
                                  "loading it unverified")
                payload, problem = _read_payload(stored.file_path(_STATE_FILE), map_location)
            if not problem:
                return stored, payload
            problems.append(problem)
            warnings.warn(f"TrainingState: {problem}; trying the previous state")
        if problems:
            listed = "\n  ".join(problems)
            raise RuntimeError(f"TrainingState.load: {self.directory} holds {len(problems)} state(s) and none can "
                               f"be loaded:\n  {listed}\nMove or delete them to start afresh; nothing was changed.")
        return None, None

    @staticmethod
    def _apply(path: Path, payload: dict, model, optimizer, scaler, restore_rng: bool, comm=None,
               scheduler=None) -> None:
        """Puts the payload into the objects (and the RNG states when asked), all or nothing; with `comm`, all or
        nothing on every rank."""
        backup = rng = error = None
        try:
            backup = StateSnapshot([o for o in (model, optimizer, scaler, scheduler) if o is not None])
            rng = _rng_states()
            if model is not None:
                model.load_state_dict(payload["model"])
            if optimizer is not None:
                optimizer.load_state_dict(payload["optimizer"])
            if scaler is not None and payload["scaler"]:  # (a disabled scaler saved {})
                scaler.load_state_dict(payload["scaler"])
            if scheduler is not None:
                if payload.get("scheduler") is None:
                    raise ValueError("scheduler= was given but the state holds no scheduler (it was saved without "
                                     "scheduler=)")
                scheduler.load_state_dict(payload["scheduler"])
            if restore_rng:
                _restore_rng_states(payload["rng"])
        except Exception as e:  # noqa: BLE001 - whatever failed, the objects go back as they were
            error = ValueError(f"TrainingState.load: {path} does not fit the objects given ({_detail(e)}); nothing "
                               "was changed")
            error.__cause__ = e
            if backup is not None:
                backup.restore()
                _restore_rng_states(rng)
        if comm is not None:
            try:
                _C.agree_loaded(comm, _first_line(error))
            except Exception:
                if error is None:  # another rank failed: this one's objects go back too
                    backup.restore()
                    _restore_rng_states(rng)
                    raise
        if error is not None:
            raise error

    @staticmethod
    def _apply_sharded(stored, payload: dict, model, optimizer, scaler, allow_reshard: bool,
                       restore_rng: bool, scheduler=None) -> None:
        """The model and scaler here, then every rank's shard (gpuops::load_sharded_state: agreed by all, then
        all or nothing)."""
        backup = rng = None
        error = ""
        try:
            backup, rng = StateSnapshot([o for o in (model, scaler, scheduler) if o is not None]), _rng_states()
            files = _C.shard_files_of(stored)
            TrainingState._apply(Path(stored.path), dict(payload, optimizer=None), model, None, scaler, restore_rng,
                                 scheduler=scheduler)
        except Exception as e:  # noqa: BLE001 - every rank must hear of it before anyone raises
            files, error = [], _first_line(e)
        try:
            _C.load_sharded_state(optimizer._impl, files, allow_reshard, error)
        except Exception:
            if not error:  # another rank failed, or the shards: this rank's part goes back too
                backup.restore()
                _restore_rng_states(rng)
            raise
        optimizer.param_groups[0].update(optimizer._impl.options)


def _own_part(payload: dict) -> bytes:
    """What this rank keeps of its own, as bytes for the gather: its RNG states, data position and extras."""
    import io

    buffer = io.BytesIO()
    torch.save({key: payload[key] for key in ("rng", "data_position", "extras")}, buffer)
    return buffer.getvalue()


def _with_parts(payload: dict, parts: list) -> dict:
    """Rank 0's payload with every rank's own part (read as state.pt is: no code runs)."""
    import io

    return dict(payload, ranks=[torch.load(io.BytesIO(p), weights_only=True) for p in parts])


def _own_of(payload: dict, rank: int, path: str) -> dict:
    """The payload with this rank's own RNG states, data position and extras in place of rank 0's."""
    ranks = payload.get("ranks") or []
    if not ranks:
        return payload
    if rank >= len(ranks):
        warnings.warn(f"TrainingState.load: {path} was saved by {len(ranks)} ranks: rank {rank} has no RNG states, "
                      "data position or extras of its own there and takes rank 0's (every saved rank's are in the "
                      "result's 'ranks')", stacklevel=3)
        return payload
    return dict(payload, **ranks[rank])


def _detail(error: BaseException) -> str:
    """The type and what matters of an error from load_state_dict: torch's "size mismatch for weight: ..." is on a
    later line of its message, so the first line that names a mismatch, else the first."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    telling = next((line for line in lines if "mismatch" in line or "Missing key" in line or "Unexpected key" in line),
                   lines[0] if lines else "")
    return f"{type(error).__name__}: {telling}"


def _first_line(error: Optional[BaseException]) -> str:
    from .dist import error_line

    return error_line(error)


def _check_map_location(map_location) -> None:
    if isinstance(map_location, (str, torch.device)):
        try:
            torch.empty(0, device=map_location)
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"TrainingState.load: map_location {map_location!r} is not a usable device "
                             f"({str(e).splitlines()[0]})") from None


def _is_sharded(optimizer) -> bool:
    from .zero import ZeroOptimizer

    return isinstance(optimizer, ZeroOptimizer)


def _read_payload(path: str, map_location):
    """(payload, None), or (None, why it cannot be used). Never unpickles code (weights_only=True)."""
    import pickle

    try:
        with _legacy_numpy_globals():
            payload = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()
        detail = next((line for line in first if "GLOBAL" in line or "Unsupported" in line), first[0] if first else "")
        return None, (f"{path} is refused: it holds pickled objects that torch.load(weights_only=True) does not load "
                      f"(code could run) ({detail.strip()})")
    except Exception as e:  # noqa: BLE001 - any unreadable file means: use the previous one
        return None, f"{path} cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    keys = {"format", "step", "epoch", "data_position", "extras", "rng", "model", "optimizer", "scaler"}
    if not isinstance(payload, dict) or payload.get("format") not in (1, _FORMAT) or not keys <= set(payload):
        return None, f"{path} cannot be read (not a gpuops training state)"
    ranks = payload.get("ranks")
    if ranks is not None and not (isinstance(ranks, list) and all(
            isinstance(r, dict) and set(r) == {"rng", "data_position", "extras"} for r in ranks)):
        return None, f"{path} cannot be read (its per-rank parts are not RNG states, data positions and extras)"
    return payload, None


def _legacy_numpy_globals():
    """Format-1 states (gpuops <= 0.1) carry numpy's RNG state as an ndarray: allow numpy's array
    reconstruction, and nothing else, while loading."""
    import contextlib

    try:
        import numpy
    except ImportError:
        return contextlib.nullcontext()
    core = getattr(numpy, "_core", None) or numpy.core
    allowed = [core.multiarray._reconstruct, numpy.ndarray, numpy.dtype, type(numpy.dtype(numpy.uint32))]
    return torch.serialization.safe_globals(allowed)
