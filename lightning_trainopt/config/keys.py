"""Every key of the composed config checked against the signature of what it is passed to, before anything is built.

A ``_target_`` node's keys are the keyword arguments of its target; the ``trainer`` node's keys are those of
Lightning's ``Trainer``. A misspelt key (``+optimizer.betaz=...``) would otherwise be accepted by Hydra and fail as a
``TypeError`` only when the object is built, for an optimizer or a scheduler only once training has started.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_trainopt.config.tree import CONF_DIR
from lightning_trainopt.exceptions import ConfigKeysError
from lightning_trainopt.optim.optimizers import BITSANDBYTES_OPTIMIZERS

__all__ = ["TRAINER_TARGET", "check_config_keys", "key_problems", "missing_key_fix", "root_keys"]

#: What the ``trainer`` node's keys are passed to (train.py adds the arguments in ``APP_TRAINER_KEYS`` itself).
TRAINER_TARGET = "lightning.pytorch.Trainer"
# Hydra's own keys of a node: how to build it, not arguments.
_HYDRA_KEYS = frozenset({"_target_", "_partial_", "_recursive_", "_convert_", "_args_"})
# Groups whose entries train.py builds one by one (each a `name: {_target_: ...}` node, or null to leave it out).
_NAMED_GROUPS = {"callbacks": "callback", "activations": "activation technique", "logger": "logger"}
# Partials the app completes: models.optimization.configure_optimizers (LitGPT, LitCausalLM, a user module without its
# own configure_optimizers) calls optimizer(param_groups) and
# scheduler(optimizer, total_steps=...). (leading positional arguments, keyword arguments)
_APP_SUPPLIED: dict[str, tuple[int, tuple[str, ...]]] = {"optimizer": (1, ()), "scheduler": (1, ("total_steps",))}
# Targets whose **kwargs go on to one known callable: their keys must be arguments of that callable (a dotted path,
# imported lazily), or one of a fixed set of names. Any other third-party **kwargs accepts every key; a class of this
# package passes its **kwargs to its base class.
_KWARGS_GO_TO: dict[str, str | tuple[str, ...]] = {
    "lightning.pytorch.strategies.ddp.DDPStrategy": "torch.nn.parallel.DistributedDataParallel",
    "lightning.pytorch.profilers.pytorch.PyTorchProfiler": "torch.profiler.profile",
    "lightning.pytorch.loggers.tensorboard.TensorBoardLogger": "torch.utils.tensorboard.writer.SummaryWriter",
    "lightning_trainopt.optim.optimizers.bnb_adamw8bit": BITSANDBYTES_OPTIMIZERS["AdamW8bit"],
    "lightning_trainopt.optim.optimizers.bnb_adam8bit": BITSANDBYTES_OPTIMIZERS["Adam8bit"],
    "lightning_trainopt.optim.optimizers.bnb_paged_adamw8bit": BITSANDBYTES_OPTIMIZERS["PagedAdamW8bit"],
    "lightning_trainopt.optim.optimizers.bnb_lion8bit": BITSANDBYTES_OPTIMIZERS["Lion8bit"],
    "lightning_trainopt.optim.optimizers.torchao_adamw8bit": "torchao.optim.AdamW8bit",
    "lightning_trainopt.optim.optimizers.torchao_adamw4bit": "torchao.optim.AdamW4bit",
}
# The app's config tree: its groups (sub-directories) and its root configs' own keys are the top-level keys.
_CONF_DIR = CONF_DIR
# Top-level keys that no root config file declares: Hydra's node, and the run directory a config composed outside
# Hydra names (``train.output_dir``).
_EXTRA_ROOT_KEYS = frozenset({"hydra", "output_dir"})
_MAX_LISTED = 12  # arguments listed in full when no name is close to the misspelt one
_MISSING = "???"  # OmegaConf's mark of a value still to be given

Problem = tuple[str, Any, str]  # (dotted key, its value, what is wrong and the fix)


class _Unimportable(Exception):
    """A ``_target_`` whose module cannot be imported for a reason other than its own path (a missing package)."""


def _full_name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"


def _locate(path: str) -> Any:
    """The object a dotted ``_target_`` names, imported as Hydra would.

    Raises:
        _Unimportable: a package the target's module imports is not installed (the pre-flight check names it).
        LookupError: nothing of that name exists (a misspelt path); the message names the nearest one.
    """
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        module_name = ".".join(parts[:end])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name and (module_name == err.name or module_name.startswith(f"{err.name}.")):
                continue  # this prefix is not a module: the rest are attributes (or a package is not installed)
            raise _Unimportable(module_name) from err
        except ImportError as err:
            raise _Unimportable(module_name) from err
        for i, attr in enumerate(parts[end:], start=end):
            if not hasattr(obj, attr):
                owner = ".".join(parts[:i])
                names = [n for n in dir(obj) if not n.startswith("_")]
                raise LookupError(f"{owner} has no {attr}{_suggestion(attr, names)}")
            obj = getattr(obj, attr)
        return obj
    raise _Unimportable(parts[0])  # not even the top-level package: not installed, or misspelt


def _suggestion(name: str, candidates: Any) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _signature(obj: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without one
        return None


def _keyword_names(obj: Any) -> set[str] | None:
    """The keyword arguments ``obj`` accepts, or ``None`` for any (a ``**kwargs`` that goes nowhere known)."""
    sig = _signature(obj)
    if sig is None:
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = {p.name for p in sig.parameters.values() if p.kind in kinds}
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return names
    forward = _KWARGS_GO_TO.get(_full_name(obj))
    if isinstance(forward, tuple):
        return names | set(forward)
    if forward is not None:
        try:
            more = _keyword_names(_locate(forward))
        except (_Unimportable, LookupError):
            return None  # e.g. TensorBoard not installed: the pre-flight check refuses the preset instead
        return None if more is None else names | more
    if inspect.isclass(obj) and obj.__module__.startswith("lightning_trainopt."):
        base = next((b for b in obj.__mro__[1:] if "__init__" in vars(b)), None)
        more = _keyword_names(base) if base is not None and base is not object else None
        return None if more is None else names | more
    return None


def _unknown_fix(target: str, key: str, accepted: set[str]) -> str:
    fix = f"unknown argument of {target}"
    close = _suggestion(key, accepted)
    if close:
        return fix + close
    if len(accepted) <= _MAX_LISTED:
        return f"{fix}; it takes {', '.join(sorted(accepted)) or 'no arguments'}."
    return f"{fix}; see its signature for the arguments it takes."


def _bind(node: dict[Any, Any], path: str, group: str) -> Iterator[Problem]:
    """The keys of one ``_target_`` node that its target does not take, and the required ones it lacks."""
    target = node["_target_"]
    if not isinstance(target, str):
        yield f"{path}._target_", target, "give the dotted path of a class or function, e.g. torch.optim.AdamW."
        return
    try:
        obj = _locate(target)
    except _Unimportable:
        return  # a missing optional package: the pre-flight check refuses it with the pip command that adds it
    except LookupError as err:
        yield f"{path}._target_", target, f"cannot be imported: {err}"
        return
    sig = _signature(obj)
    accepted = _keyword_names(obj)
    if sig is None:
        return
    keys = [str(k) for k in node if k not in _HYDRA_KEYS]
    partial = bool(node.get("_partial_", False))
    n_supplied, supplied_keywords = _APP_SUPPLIED.get(group, (0, ())) if partial and path == group else (0, ())
    positional = [
        p.name
        for p in sig.parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    app_sets = set(positional[:n_supplied]) | set(supplied_keywords)
    for key in keys:
        if key in app_sets:
            yield f"{path}.{key}", node[key], f"the app passes this argument of {target} itself; remove it."
        elif accepted is not None and key not in accepted:
            yield f"{path}.{key}", node[key], _unknown_fix(target, key, accepted - app_sets)
    given = set(keys) | app_sets | set(positional[: len(node.get("_args_") or ())])
    for p in sig.parameters.values():
        required = p.default is inspect.Parameter.empty and p.kind in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.KEYWORD_ONLY,
        )
        if required and p.name not in given:
            yield f"{path}.{p.name}", _MISSING, f"missing argument of {target}; add +{path}.{p.name}=..."


def _walk(value: Any, path: str, group: str) -> Iterator[Problem]:
    """Bind every ``_target_`` node at or below ``value``; an interpolation (a string here) is bound where it points."""
    if isinstance(value, dict):
        if "_target_" in value:
            yield from _bind(value, path, group)
        for key, child in value.items():
            if key not in _HYDRA_KEYS:
                yield from _walk(child, f"{path}.{key}", group)
    elif isinstance(value, list):
        for i, child in enumerate(value):
            yield from _walk(child, f"{path}[{i}]", group)


def _trainer(node: Any) -> Iterator[Problem]:
    if not isinstance(node, dict):
        return
    accepted = _keyword_names(_locate(TRAINER_TARGET)) or set()
    for key, value in node.items():
        # The arguments train.py sets itself (trainer.precision, ...) are Trainer arguments: validate_config refuses
        # them with the group to use instead.
        if key not in accepted:
            yield f"trainer.{key}", value, _unknown_fix(TRAINER_TARGET, str(key), accepted)
        yield from _walk(value, f"trainer.{key}", "trainer")


def _named_group(group: str, node: Any) -> Iterator[Problem]:
    if not isinstance(node, dict):
        return
    built = [str(k) for k, v in node.items() if isinstance(v, dict) and "_target_" in v]
    for name, entry in node.items():
        if entry is None:
            continue  # `callbacks.gpu_monitor=null` leaves one out
        if isinstance(entry, dict) and "_target_" in entry:
            yield from _walk(entry, f"{group}.{name}", group)
            continue
        close = difflib.get_close_matches(str(name), built, n=1, cutoff=0.6)
        fix = f"not a {_NAMED_GROUPS[group]}: it has no _target_, so nothing would be built from it; "
        if close:
            fix += f"did you mean {group}.{close[0]}?"
        else:
            fix += f"add a preset with {group}=[...,<preset>] (conf/{group}/) or give {group}.{name}._target_."
        yield f"{group}.{name}", entry, fix


@cache
def root_keys(config_name: str = "train", conf_dir: Path = _CONF_DIR) -> frozenset[str]:
    """The top-level keys a config composed from ``conf/<config_name>.yaml`` may have.

    The config groups (``conf/<group>/`` directories), the keys of the root config and of the root configs its
    defaults list includes (``plan.yaml`` includes ``train``). Read from the config tree itself, so a group or a root
    key added there is known without a list to update. Empty when the file is not found (nothing is then checked).
    """
    root = conf_dir / f"{config_name}.yaml"
    if not root.is_file():
        return frozenset()
    keys = set(_EXTRA_ROOT_KEYS) | {p.name for p in conf_dir.iterdir() if p.is_dir()}
    node = OmegaConf.load(root)
    if isinstance(node, DictConfig):
        keys.update(str(k) for k in node if k != "defaults")
        for entry in node.get("defaults") or []:
            if isinstance(entry, str) and entry != "_self_" and (conf_dir / f"{entry}.yaml").is_file():
                keys |= root_keys(entry, conf_dir)
    return frozenset(keys)


def _config_name(cfg: DictConfig) -> str:
    """The root config ``cfg`` was composed from: ``plan`` when it has a plan node, else Hydra's job config name."""
    from hydra.core.hydra_config import HydraConfig

    if "plan" in cfg:
        return "plan"  # plan.py's, or a train config the ladder plans (it adds the plan node)
    if HydraConfig.initialized():
        name = HydraConfig.get().job.config_name
        if name:
            return str(name)
    return "train"


def _root_key(key: str, value: Any, known: frozenset[str]) -> Problem:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    scalars = sorted(k for k in known if not (_CONF_DIR / k).is_dir() and k not in _EXTRA_ROOT_KEYS | {"plan"})
    fix = f"no such top-level key; did you mean {close[0]}?" if close else "no such top-level key; remove it."
    settings = ", ".join(scalars)
    return key, value, f"{fix} The top-level settings are {settings}; a group's key goes under it (data.seed)."


def key_problems(cfg: DictConfig) -> list[Problem]:
    """``(key, value, fix)`` for every key that what it is passed to does not take, and every argument missing.

    A top-level key must be a config group or a key of the root config ``cfg`` was composed from (:func:`root_keys`:
    ``+sead=1`` is refused). Keys are bound to the signature of their node's ``_target_`` (nested targets too); a target
    that takes ``**kwargs`` accepts any key unless they are known to go on to a callable with a signature (a class of
    this package passes them to its base class, ``DDPStrategy`` to torch's ``DistributedDataParallel``, ...). The
    arguments the app passes a partial itself (an optimizer's parameters, a scheduler's optimizer and ``total_steps``)
    are not for the config to give. A target whose module cannot be imported because a package is missing is skipped:
    the pre-flight check refuses it with the command that installs the package.

    Args:
        cfg: the composed config of ``conf/train.yaml`` (or ``conf/plan.yaml``).
    """
    plain = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(plain, dict)
    problems: list[Problem] = []
    known = root_keys(_config_name(cfg))
    for group, node in plain.items():
        group = str(group)
        if group == "hydra":
            continue
        if known and group not in known:
            problems.append(_root_key(group, node, known))
            continue
        if group == "trainer":
            problems.extend(_trainer(node))
        elif group in _NAMED_GROUPS:
            problems.extend(_named_group(group, node))
        else:
            problems.extend(_walk(node, group, group))
    return problems


def check_config_keys(cfg: DictConfig) -> None:
    """Raise :class:`ConfigKeysError` listing every problem :func:`key_problems` finds, with the nearest valid key.

    Raises:
        ConfigKeysError: one or more keys are not arguments of their targets, or a required argument is missing.
    """
    problems = key_problems(cfg)
    if problems:
        raise ConfigKeysError(problems)


def missing_key_fix(path: str, parent: Any, override: str) -> str:
    """What to say about ``path``, a key Hydra refused to override because the composed config lacks it.

    A key that the node's target takes (Lightning's ``Trainer`` under ``trainer``) is added with a ``+``; any other is
    an unknown argument, with the nearest valid name.

    Args:
        path: the dotted key that is missing, e.g. ``trainer.max_step``.
        parent: the config node it was meant for (the root config for a top-level key).
        override: the command-line override that named it, without a leading ``+``, e.g. ``trainer.max_step=20``.
    """
    parent_path, _, key = path.rpartition(".")
    target = None
    if parent_path == "trainer":
        target = TRAINER_TARGET
    elif isinstance(parent, (dict, DictConfig)) and isinstance(parent.get("_target_"), str):
        target = parent["_target_"]
    if target is not None:
        try:
            accepted = _keyword_names(_locate(target))
        except (_Unimportable, LookupError):
            accepted = None
        if accepted is None or key in accepted:
            return f"{path} is not in the config yet; add it with a +: +{override}"
        return _unknown_fix(target, key, accepted)
    known = [str(k) for k in parent] if isinstance(parent, (dict, DictConfig)) else []
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return f"no such key; did you mean {f'{parent_path}.' if parent_path else ''}{close[0]}?"
    return f"no such key in the config; a new key needs a +: +{override}"
