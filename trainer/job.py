"""The job a user brings: a torchtitan config-registry entry, with the overrides a user changes.

``--config NAME`` names a function returning a torchtitan ``Trainer.Config``, looked up as
torchtitan's ``ConfigManager`` does for ``--module M --config NAME``: in this project's own
registry (:mod:`trainer.configs`, the zero-download defaults), in torchtitan's model registries
(``llama3_debugmodel``, ``llama3_8b``, ``qwen3_debugmodel``, ``qwen3_0_6b``, …; the module is the
name's prefix), or in a user's own module (``my_pkg.configs:my_llama``). The trainer's flags then
override what a user changes per run: tokenizer folder, sequence length, local batch, steps,
learning rate and schedule, precision, activation checkpointing, compile.

What this service needs of every config, it sets here: FSDP only inside a group (the
``partial_dtensor`` path: no tensor, pipeline or context parallelism), plain causal SDPA (works
on every device; packed samples attend across document boundaries, as torchtitan's SDPA does).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from trainer.errors import ConfigError

OWN_REGISTRY = "trainer.configs"
TESTED_MODELS = ("llama3", "qwen3")
"""torchtitan's model modules whose configs this service is tested with; others may work."""
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def _torchtitan_modules() -> list[str]:
    from torchtitan.models import _supported_models

    return sorted(_supported_models, key=len, reverse=True)  # qwen3_5 before qwen3


def _registry(module: str) -> Any | None:
    from trainer.lean_import import import_quietly

    try:
        return import_quietly(module)
    except ImportError:
        return None


def _entries(module: Any) -> list[str]:
    return [name for name, value in vars(module).items()
            if callable(value) and not name.startswith("_") and getattr(value, "__module__", None) == module.__name__]


def find_config(name: str) -> Callable[[], Any]:
    """The config function ``name`` names; ConfigError (with the closest names) when none does."""
    if ":" in name:
        module_name, _, function = name.partition(":")
        module = _registry(module_name)
        if module is None:
            raise ConfigError(f"--config {name}: cannot import module {module_name!r}")
        found = getattr(module, function, None)
        if not callable(found):
            raise ConfigError(f"--config {name}: {module_name} has no config function {function!r}; it has "
                              f"{', '.join(_entries(module)) or 'none'}")
        return found
    candidates = [OWN_REGISTRY] + [f"torchtitan.models.{m}.config_registry" for m in _torchtitan_modules()
                                   if name.startswith(m + "_")]
    for module_name in candidates:
        module = _registry(module_name)
        if module is not None and callable(getattr(module, name, None)):
            return getattr(module, name)
    known = []
    for module_name in [OWN_REGISTRY] + [f"torchtitan.models.{m}.config_registry" for m in TESTED_MODELS]:
        module = _registry(module_name)
        known += _entries(module) if module is not None else []
    close = difflib.get_close_matches(name, known, n=4, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else f"for example {', '.join(known[:6])}"
    raise ConfigError(f"unknown --config {name!r}: no torchtitan config-registry function of that name ({hint}; "
                      "or MODULE:FUNCTION for your own)")


@contextmanager
def quiet_root_logger() -> Iterator[None]:
    """torchtitan logs through the root logger; while its config is built, only its errors show."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def job_config(cfg: Any) -> Any:
    """The torchtitan ``Trainer.Config`` of the run: ``--config`` with the trainer's overrides.

    ``cfg`` is the trainer's settings (:class:`trainer.config.TrainerConfig`)."""
    from trainer.cpu_compat import use_sdpa_attention
    from trainer.lean_import import import_quietly

    Decoder = import_quietly("torchtitan.models.common.decoder").Decoder
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    with quiet_root_logger():  # torchtitan's config classes warn of options this service does not use
        job = find_config(cfg.config)()
    spec = job.model_spec
    if spec is None or not isinstance(spec.model, Decoder.Config):
        raise ConfigError(f"--config {cfg.config} is not a decoder language model; this service trains "
                          f"torchtitan's decoders ({', '.join(TESTED_MODELS)}, …)")
    if cfg.tokenizer is not None:
        job.hf_assets_path = str(cfg.tokenizer)
    training = job.training
    training.steps = cfg.steps
    for field in ("seq_len", "local_batch_size", "max_norm"):
        if getattr(cfg, field) is not None:
            setattr(training, field, getattr(cfg, field))
    training.mixed_precision_param = DTYPES[cfg.precision]
    if cfg.lr is not None:
        for group in job.optimizer.param_groups:
            group.optimizer_kwargs = {**group.optimizer_kwargs, "lr": cfg.lr}
    schedule = job.lr_scheduler
    for field in ("warmup_steps", "decay_type", "min_lr_factor"):
        if getattr(cfg, field) is not None:
            setattr(schedule, field, getattr(cfg, field))
    if schedule.warmup_steps >= cfg.steps:
        schedule.warmup_steps = max(0, cfg.steps - 1)  # torchtitan refuses a warm-up as long as the run
    if cfg.activation_checkpoint is not None:
        job.activation_checkpoint = {"none": None, "selective": SelectiveAC.Config(),
                                     "full": FullAC.Config()}[cfg.activation_checkpoint]
    job.compile = dataclasses.replace(job.compile, enable=cfg.compile)
    job.parallelism.spmd_backend = "partial_dtensor"
    use_sdpa_attention(spec.model)
    return job


def model_limits(job: Any) -> tuple[int, int]:
    """(vocabulary size, longest sequence) of the job's model, before the run's seq_len resizes it."""
    model = job.model_spec.model
    try:
        longest = model.max_seq_len
    except ValueError:
        longest = 1 << 30  # no RoPE: no limit of its own
    return model.vocab_size, longest


def describe(job: Any) -> str:
    spec = job.model_spec
    return f"{spec.name} {spec.flavor}"


@dataclasses.dataclass(frozen=True)
class SyncSettings:
    """How the groups train together (``--sync`` and its knobs), resolved against the config."""

    mode: str = "hsdp"
    sync_every: int = 20
    fragments: int = 1
    outer_lr: float = 0.7
    outer_momentum: float = 0.9

    @property
    def semi_sync(self) -> bool:
        return self.mode != "hsdp"

    @property
    def every(self) -> int:
        """Inner steps between two syncs (each of one fragment)."""
        return self.sync_every // self.fragments


SYNC_METHODS = {"diloco": "diloco", "local_sgd": "localsgd"}
"""torchtitan's ``fault_tolerance.semi_sync_method`` values, as ``--sync`` names them."""


def sync_settings(cfg: Any, job: Any) -> SyncSettings:
    """``--sync`` and its knobs; each one unset is the config's own (torchtitan's
    ``fault_tolerance`` of its torchft experiment: ``semi_sync_method``, ``sync_steps``,
    ``num_fragments``), else the default. ConfigError for a combination that cannot train."""
    ft = getattr(job, "fault_tolerance", None)
    from_config = ft is not None and getattr(ft, "enable", False) and getattr(ft, "semi_sync_method", None)
    own = SyncSettings(mode=SYNC_METHODS.get(str(ft.semi_sync_method).lower(), "hsdp"), sync_every=ft.sync_steps,
                       fragments=ft.num_fragments) if from_config else SyncSettings()
    chosen = {name: getattr(cfg, name) for name in ("sync", "sync_every", "fragments", "outer_lr", "outer_momentum")
              if getattr(cfg, name) is not None}
    if "sync" in chosen:
        chosen["mode"] = chosen.pop("sync")
    settings = dataclasses.replace(own, **chosen)
    if not settings.semi_sync:
        return settings
    if settings.sync_every % settings.fragments:
        raise ConfigError(f"--sync-every {settings.sync_every} does not divide into --fragments {settings.fragments}: "
                          "each fragment syncs every H/F steps; use a multiple of the fragments")
    if cfg.steps % settings.every:
        raise ConfigError(f"--steps {cfg.steps} is not a multiple of the {settings.every} inner steps between two "
                          f"syncs (--sync-every {settings.sync_every} / --fragments {settings.fragments}): the job "
                          "ends at a sync; round --steps to a multiple")
    if cfg.world_size_mode != "dynamic":
        raise ConfigError(f"--sync {settings.mode} trains with --world-size-mode dynamic only: every group that is "
                          "up trains its share of each window")
    return settings
