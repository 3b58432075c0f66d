"""Training telemetry: ``gpuops.metrics.Recorder`` over the C++ MetricsRecorder (docs/telemetry.md).

    recorder = gpuops.metrics.Recorder(log_every=10, jsonl="run/metrics.jsonl", csv="run/metrics.csv")
    for batch in loader:
        ...
        scaler.step(optimizer); scaler.update()
        recorder.step_done(loss, optimizer=optimizer, scaler=scaler, grad_norm=norm, tokens=batch.numel())
    recorder.close()

Nothing on the step path reads a device value: the loss, the gradient norm and the scaler's scale and skipped
count are combined on their device and read once per ``log_every`` steps.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Union

import torch

from .. import _C


def prometheus_available() -> bool:
    """True: every build of gpuops serves Prometheus (kept from when the endpoint needed cpp-httplib)."""
    return _C.prometheus_available()


def tensorboard_available() -> bool:
    """True when this build of gpuops writes TensorBoard event files (it was built with protobuf-lite and Boost)."""
    return _C.tensorboard_available()


def _path(name: str, value: Any) -> str:
    """A file or folder argument: None (none: ""), a str or an os.PathLike naming a str path. An int would name a
    file called "3" and bytes their repr: refused, naming the argument (a NUL byte is refused by the engine)."""
    if value is None:
        return ""
    path = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(path, str):
        raise TypeError(f"Recorder: {name} must be a path (str or os.PathLike of str) or None, got "
                        f"{type(value).__name__}")
    return path


def _default_rank() -> tuple:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _host_lrs(optimizer: Optional[torch.optim.Optimizer]) -> List[float]:
    """Each group's lr as a number; a device tensor lr is not read (it would sync): NaN then."""
    if optimizer is None:
        return []
    lrs = []
    for group in optimizer.param_groups:
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            lrs.append(float(lr) if lr.device.type == "cpu" else math.nan)
        else:
            lrs.append(float(lr))
    return lrs


def _scaler_tensors(scaler: Any) -> tuple:
    """(scale, skipped count) of a GradScaler as device tensors, without reading them: gpuops.GradScaler keeps
    both; torch's keeps its scale only."""
    if scaler is None or not getattr(scaler, "_enabled", True):
        return None, None
    scale = getattr(scaler, "_scale", None)
    skipped = getattr(scaler, "_skipped", None)
    return (scale if isinstance(scale, torch.Tensor) else None,
            skipped if isinstance(skipped, torch.Tensor) else None)


def _flops_per_token(given: Optional[float], model: Any, seq_len: Optional[int]) -> float:
    if given is not None:
        if model is not None:
            raise ValueError("Recorder: give flops_per_token or model, not both")
        return float(given)
    if model is None:
        return 0.0
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"Recorder: seq_len must be an int >= 1 with model=, got {seq_len!r}")
    from ..estimator import _model_spec  # the estimator's model resolution: presets, Hub ids, configs, modules

    return _model_spec(model, None, None).training_flops_per_token(seq_len)


def _peak_flops(peak_tflops: Optional[float], gpu: Optional[str]) -> float:
    """The peak FLOP/s MFU is measured against: given, the catalog GPU named, or the catalog GPU all of whose name's
    parts are words of the CUDA device's name ("NVIDIA A100-SXM4-80GB" is A100-80GB); 0 when none is known."""
    if peak_tflops is not None:
        if isinstance(peak_tflops, bool) or not isinstance(peak_tflops, (int, float)) or not 0 < peak_tflops < math.inf:
            raise ValueError(f"Recorder: peak_tflops must be a finite number > 0, got {peak_tflops!r}")
        return float(peak_tflops) * 1e12
    from ..estimator import gpu_catalog

    catalog = {g["name"]: g["tensor_tflops"] for g in gpu_catalog()}
    if gpu is not None:
        if gpu not in catalog:
            raise ValueError(f"Recorder: gpu {gpu!r} is not in the catalog; accepted: {', '.join(catalog)}")
        return catalog[gpu] * 1e12
    if not torch.cuda.is_available():
        return 0.0
    words = set(torch.cuda.get_device_name().upper().replace("-", " ").split())
    matches = [name for name in catalog if set(name.upper().split("-")) <= words]
    return catalog[max(matches, key=lambda n: len(n.split("-")))] * 1e12 if matches else 0.0


def _as_value(name: str, value: Any) -> Optional[torch.Tensor]:
    """A reported value as a tensor (kept as it is: not read): a tensor, a real number or None."""
    if value is None or isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value), dtype=torch.float64)
    raise TypeError(f"Recorder.step_done: {name} must be a tensor, a number or None, got {type(value).__name__}")


def _nvml_gpu(device_monitor) -> str:
    """The NVML name of the GPU to monitor: its PCI bus id (NVML's indices ignore CUDA_VISIBLE_DEVICES), "" for
    none."""
    if device_monitor is None or (device_monitor == "auto" and not torch.cuda.is_available()):
        return ""
    if isinstance(device_monitor, str) and device_monitor != "auto":
        return device_monitor
    if isinstance(device_monitor, bool) or not isinstance(device_monitor, (int, str)):
        raise TypeError("Recorder: device_monitor must be 'auto', a CUDA device index, an NVML PCI bus id or None, "
                        f"got {type(device_monitor).__name__}")
    index = torch.cuda.current_device() if device_monitor == "auto" else device_monitor
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(f"Recorder: device_monitor {index} is not a CUDA device; accepted: 0 .. "
                         f"{torch.cuda.device_count() - 1}")
    p = torch.cuda.get_device_properties(index)
    return f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"


class Recorder:
    """Records the figures of each optimizer step and writes one record per ``log_every`` steps to JSON Lines
    (``jsonl``) and CSV (``csv``) files. ``rank`` and ``world_size`` default to torch.distributed's; rank 0
    writes, or every rank to ``<path>.rank<r>`` with ``every_rank_writes=True``. A file that already holds
    records is continued (a resumed run writes no step twice; a partial last line is cut off). ``start_step``
    is the number of optimizer steps done before this recorder (a resumed run's step). ``callback`` receives
    each record as a dict on the ranks that write (an exception it raises is a warning; training goes on).

    TFLOPS and MFU: ``flops_per_token``, or ``model`` (a preset, Hub id, config or Hugging Face model, as
    ``gpuops.estimate`` takes it) with ``seq_len``, counted by PaLM's formula (6 per parameter without the token
    table, plus attention); the peak is ``peak_tflops``, else the catalog GPU named ``gpu``, else the catalog GPU
    whose name the CUDA device's contains (its dense 16-bit tensor rate). The record's ``peak_tflops`` says
    which peak was used.

    ``communicator`` (a ``gpuops.dist.Communicator``): every record also holds figures over all ranks (total
    tokens/s and samples/s, the slowest step, the largest peaks) and this rank's collective bytes per step; every
    rank must then record the same steps and close the recorder.

    ``tensorboard``: a folder for TensorBoard event files (made if missing; every rank in ``<folder>/rank<r>`` with
    ``every_rank_writes``), each record's figures as scalars ``gpuops/<figure>`` at its step (written by the C++
    engine: ``tensorboard_available()``); a resumed run (``start_step`` > 0) has TensorBoard drop the earlier
    run's events after ``start_step``.

    ``prometheus_port``: every rank serves its latest record at ``http://<prometheus_address>:<port + rank>/metrics``
    in Prometheus' text format (0: a free port, see ``prometheus_port``), labelled with ``job``, ``rank`` and
    ``world_size``, from a thread of its own; only ``prometheus_address`` (default 127.0.0.1) is bound.

    ``device_monitor``: the GPU whose figures each record holds, as nvidia-smi shows them (``gpu_util_pct``,
    ``gpu_memory_used_bytes``, ``gpu_temperature_c``, ``gpu_power_w``, ``gpu_sm_clock_mhz``, ``gpu_energy_j``
    and ``joules_per_token``), read through NVML loaded at run time by a thread of its own every
    ``device_monitor_s`` seconds: "auto" (the current CUDA device, none without CUDA), a CUDA device index, an
    NVML PCI bus id ("00000000:3B:00.0"), or None. Without NVML the figures are NaN."""

    def __init__(self, log_every: int = 10, jsonl: Optional[str] = None, csv: Optional[str] = None, *,
                 rank: Optional[int] = None, world_size: Optional[int] = None, every_rank_writes: bool = False,
                 start_step: int = 0, callback: Optional[Callable[[Dict[str, Any]], None]] = None,
                 flops_per_token: Optional[float] = None, model: Any = None, seq_len: Optional[int] = None,
                 peak_tflops: Optional[float] = None, gpu: Optional[str] = None, communicator: Any = None,
                 prometheus_port: Optional[int] = None, prometheus_address: str = "127.0.0.1",
                 job: str = "gpuops", tensorboard: Optional[str] = None,
                 device_monitor: Union[None, str, int] = "auto", device_monitor_s: float = 1.0) -> None:
        default_rank, default_world = ((communicator.rank, communicator.size) if communicator is not None
                                        else _default_rank())
        if callback is not None and not callable(callback):
            raise TypeError(f"Recorder: callback must be callable or None, got {type(callback).__name__}")
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"Recorder: start_step must be an int >= 0, got {start_step!r}")
        rank = default_rank if rank is None else rank
        world_size = default_world if world_size is None else world_size
        self._native = _C.MetricsRecorder(
            log_every=log_every, jsonl=_path("jsonl", jsonl), csv=_path("csv", csv),
            rank=rank, world_size=world_size, every_rank_writes=every_rank_writes,
            callback=(lambda record: callback(Recorder._as_dict(record))) if callback is not None else None,
            flops_per_token=_flops_per_token(flops_per_token, model, seq_len),
            peak_flops=_peak_flops(peak_tflops, gpu), communicator=communicator,
            prometheus_port=-1 if prometheus_port is None else prometheus_port,
            prometheus_address=prometheus_address, job=job, tensorboard=_path("tensorboard", tensorboard),
            gpu_monitor=_nvml_gpu(device_monitor), gpu_sample_s=device_monitor_s)
        self._step = start_step
        self._loader_wait: Optional[float] = None  # seconds timed() waited since the last step (None: not used)

    def step_done(self, loss: Any = None, *, optimizer: Optional[torch.optim.Optimizer] = None, scaler: Any = None,
                  grad_norm: Optional[torch.Tensor] = None, tokens: int = 0, samples: int = 0,
                  data_wait: Optional[float] = None) -> None:
        """One optimizer step done: its loss (a tensor, not read here, or a number), the optimizer (its groups'
        learning rates), the GradScaler (its scale and skipped steps), the gradient norm ``clip_grad_norm_``
        returned, the tokens and samples it trained on, and the seconds it waited for its data (``data_wait``;
        by default what ``timed(loader)`` measured since the last step)."""
        loss, grad_norm = _as_value("loss", loss), _as_value("grad_norm", grad_norm)
        for name, count in (("tokens", tokens), ("samples", samples)):
            if isinstance(count, bool) or not isinstance(count, int):
                raise TypeError(f"Recorder.step_done: {name} must be an int >= 0, got {type(count).__name__}")
        if data_wait is not None and (isinstance(data_wait, bool) or not isinstance(data_wait, (int, float))):
            raise TypeError(f"Recorder.step_done: data_wait must be a number of seconds or None, got "
                            f"{type(data_wait).__name__}")
        wait = self._loader_wait if data_wait is None else float(data_wait)
        scale, skipped = _scaler_tensors(scaler)
        try:
            self._native.step_done(step=self._step + 1, loss=loss, grad_norm=grad_norm, loss_scale=scale,
                                   skipped_steps=skipped, lrs=_host_lrs(optimizer), tokens=tokens, samples=samples,
                                   data_wait_s=wait)
        except (KeyboardInterrupt, SystemExit):  # the callback stopped the run: the step itself was recorded
            self._step += 1
            self._loader_wait = None
            raise
        self._step += 1  # after the native call: a refused report does not count as a step
        self._loader_wait = None  # the next step's wait: timed() measures it again, or nothing was measured

    def timed(self, loader: Iterable[Any]) -> Iterator[Any]:
        """``loader``'s items, timing each ``next()``: the time waited goes to the next ``step_done`` as its
        ``data_wait`` (the record's ``data_wait_share``: the share of the interval spent waiting for data)."""
        iterator = iter(loader)
        while True:
            start = time.perf_counter()
            try:
                item = next(iterator)
            except StopIteration:
                return
            finally:
                self._loader_wait = (self._loader_wait or 0.0) + time.perf_counter() - start
            yield item

    def flush(self) -> Optional[Dict[str, Any]]:
        """The record of the steps since the last one, made and written now (None if there are none)."""
        record = self._native.flush()
        return None if record is None else self._as_dict(record)

    def close(self) -> Optional[Dict[str, Any]]:
        """``flush()``, then the Prometheus endpoint (if any) stops serving and frees its port."""
        record = self._native.close()
        return None if record is None else self._as_dict(record)

    @staticmethod
    def _as_dict(record) -> Dict[str, Any]:
        out: Dict[str, Any] = {"step": record.step}
        out.update({name: (None if math.isnan(value) else value) for name, value in record.figures})
        out["lr"] = list(record.lrs)
        return out

    @property
    def host_reads(self) -> int:
        """Device-to-host reads so far: one per record with values on a GPU (CPU values are read where they are)."""
        return self._native.host_reads

    @property
    def resumed_after(self) -> int:
        """The last step the files already held when the recorder opened them (0: none)."""
        return self._native.resumed_after

    @property
    def prometheus_port(self) -> Optional[int]:
        """The port this rank's Prometheus endpoint serves on (None: no endpoint)."""
        port = self._native.prometheus_port
        return None if port < 0 else port

    @property
    def step(self) -> int:
        return self._step

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


FIGURES = tuple(_C.metric_figure_names())

