"""Private attributes of torch, Lightning, Hydra, OmegaConf, DeepSpeed, transformers are touched in ``_compat/`` alone.

The scan reads every module of the package outside ``_compat/`` and reports, with file and line:

* an import of a private upstream module or name (``from torch._subclasses ...``, ``import hydra._internal``,
  ``from lightning.fabric.utilities.types import _PATH``);
* an attribute ``obj._name`` or ``getattr(obj, "_name")`` whose name the package does not define itself;
* a method of one of our classes that overrides a private method of an upstream base class.

Our own private names (defined by a ``def``, a ``class``, an assignment in a class body or to ``self._name``) are
fine. A name we define that an upstream package also uses privately cannot be told apart by a scan; review keeps
those in ``_compat`` too.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap
from pathlib import Path

import pytest

import lightning_trainopt

UPSTREAM = {
    "torch",
    "lightning",
    "lightning_fabric",
    "pytorch_lightning",
    "hydra",
    "omegaconf",
    "deepspeed",
    "transformers",
}
PACKAGE = Path(lightning_trainopt.__file__).parent
_ACCESSORS = {"getattr", "setattr", "hasattr", "delattr"}

#: Public despite the underscore: Hydra's config keys (``_target_``, ``_partial_``) end in one, and namedtuple's API.
_PUBLIC = {"_fields", "_replace", "_asdict", "_make", "_field_defaults"}
#: Set on every class by the machinery that creates it (``abc.ABCMeta``, ``torch.autograd.Function``), not by us.
_MACHINERY = {"_abc_impl", "_backward_cls"}


def _private(name: str) -> bool:
    """A private name: a leading underscore, but not a dunder, a Hydra key, namedtuple's API, or our ``_trainopt``."""
    return name.startswith("_") and not name.endswith("_") and name not in _PUBLIC and not name.startswith("_trainopt")


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "_compat" not in p.relative_to(PACKAGE).parts)


def _our_names(trees: dict[Path, ast.Module]) -> set[str]:
    """Every private name the package itself defines (``_compat/`` included: its helpers are ours)."""
    names: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            if isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
                    names.update(t.id for t in targets if isinstance(t, ast.Name))
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if (
                        isinstance(target, ast.Attribute)
                        and isinstance(target.value, ast.Name)
                        and target.value.id in ("self", "cls")
                    ):
                        names.add(target.attr)
                    elif isinstance(target, ast.Name):
                        names.add(target.id)
    return {n for n in names if _private(n)}


def _upstream(module: str | None) -> bool:
    return module is not None and module.split(".")[0] in UPSTREAM


def _violations_in(tree: ast.Module, ours: set[str]) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and _upstream(node.module):
            module = node.module or ""
            if any(_private(part) for part in module.split(".")):
                found.append((node.lineno, module))
            found.extend((node.lineno, f"{module}.{a.name}") for a in node.names if _private(a.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _upstream(alias.name) and any(_private(part) for part in alias.name.split(".")):
                    found.append((node.lineno, alias.name))
        elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in ours:
            found.append((node.lineno, node.attr))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _ACCESSORS
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and node.args[1].value not in ours
        ):
            found.append((node.lineno, node.args[1].value))
    return found


def _scan() -> list[str]:
    trees = {p: ast.parse(p.read_text(), str(p)) for p in PACKAGE.rglob("*.py")}
    ours = _our_names(trees)
    found = _upstream_overrides()
    for path in _sources():
        rel = str(path.relative_to(PACKAGE))
        found.extend((rel, f"{line}: {name}", name) for line, name in _violations_in(trees[path], ours))
    return [f"{rel}: {where}" for rel, where, _ in found]


def _upstream_private_names(cls: type) -> set[str]:
    """The private names ``cls``'s upstream base classes define: methods, class attributes, ``self._x`` assignments."""
    names: set[str] = set()
    for base in cls.__mro__[1:]:
        if not _upstream(base.__module__):
            continue
        names.update(n for n in vars(base) if _private(n))
        try:
            tree = ast.parse(inspect.getsource(base))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            is_self = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
            if is_self and isinstance(node.ctx, ast.Store) and _private(node.attr):
                names.add(node.attr)
    return names


def _body_names(tree: ast.Module) -> set[str]:
    """The names the (first) class statement of ``tree`` binds in its own body: methods and class attributes."""
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef)).body
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _class_violations(cls: type) -> list[str]:
    """Private upstream names ``cls`` overrides or reaches through ``self``/``super()`` in its own body."""
    inherited = _upstream_private_names(cls)
    if not inherited:
        return []
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        defined = {n for n in vars(cls) if n in inherited and n not in _MACHINERY}
        return sorted(f"{cls.__name__}.{n} overrides a private upstream method" for n in defined)
    # What the class body defines, read from its source: ``vars(cls)`` also holds what others set on the class at
    # run time (DeepSpeed's zero.Init leaves ``_old_init`` on every nn.Module subclass alive when it ran).
    overridden = (n for n in _body_names(tree) if n in inherited and n not in _MACHINERY)
    found = {f"{cls.__name__}.{n} overrides a private upstream method" for n in overridden}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr in inherited):
            continue
        target = node.value
        is_self = isinstance(target, ast.Name) and target.id in ("self", "cls")
        is_super = isinstance(target, ast.Call) and isinstance(target.func, ast.Name) and target.func.id == "super"
        if is_self or is_super:
            found.add(f"{cls.__name__} uses the private upstream {node.attr}")
    return sorted(found)


def _upstream_overrides() -> list[tuple[str, str, str]]:
    """``(file, finding, name)`` for each class of ours that overrides or uses a private name of its upstream base."""
    found = []
    for info in pkgutil.walk_packages([str(PACKAGE)], "lightning_trainopt."):
        if info.name.startswith("lightning_trainopt._compat"):
            continue
        module = importlib.import_module(info.name)
        for cls in vars(module).values():
            if inspect.isclass(cls) and cls.__module__ == module.__name__:
                rel = str(Path(inspect.getfile(cls)).relative_to(PACKAGE))
                found.extend((rel, finding, finding.rsplit(" ", 1)[-1]) for finding in _class_violations(cls))
    return found


def test_no_private_upstream_attribute_outside_compat():
    report = _scan()
    assert not report, (
        "private attributes of torch/lightning/hydra/omegaconf/deepspeed/transformers used outside "
        "lightning_trainopt/_compat/; wrap each in a named, version-guarded function of "
        "_compat/<upstream>_internals.py with a test in tests/unit/compat/:\n" + "\n".join(report)
    )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from torch._subclasses.fake_tensor import FakeTensorMode\n", ["torch._subclasses.fake_tensor"]),
        ("import hydra._internal.utils\n", ["hydra._internal.utils"]),
        ("from lightning.fabric.utilities.types import _PATH\n", ["lightning.fabric.utilities.types._PATH"]),
        ("x = t._version\n", ["_version"]),
        ("x = getattr(loop, '_on_before_fetch', None)\n", ["_on_before_fetch"]),
        ("x = self._mine\n", []),
        ("from lightning_trainopt._compat import torch_internals\n", []),
        ("x = obj.__dict__\n", []),
    ],
)
def test_the_scan_finds_what_it_must(source, expected):
    # A scan that found nothing for lack of looking would pass the test above: it must catch each form.
    assert [name for _, name in _violations_in(ast.parse(source), {"_mine"})] == expected


def test_a_class_reaching_into_its_upstream_base_is_found():
    # A subclass's override of, call to, or write of its Lightning base's private names: each must be seen.
    from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar

    class Bar(RichProgressBar):
        def _get_train_description(self, current_epoch: int) -> str:
            return super()._get_train_description(current_epoch)

    class Checkpoint(ModelCheckpoint):
        def mine(self) -> None:
            self._last_global_step_saved = 0

    assert _class_violations(Bar) == [
        "Bar uses the private upstream _get_train_description",
        "Bar._get_train_description overrides a private upstream method",
    ]
    assert _class_violations(Checkpoint) == ["Checkpoint uses the private upstream _last_global_step_saved"]


def test_what_others_set_on_a_class_at_run_time_is_not_its_override():
    # DeepSpeed's zero.Init sets ``_old_init`` on every nn.Module subclass alive when it runs and never removes it; in
    # a test process where it had run, ``vars(cls)`` of our modules held it (CI's failure). Only what the class body
    # defines is an override; the same name defined in the body still is.
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Layer(torch.nn.Linear):
        pass

    class Checkpoint(ModelCheckpoint):
        def _save_last_checkpoint(self, trainer, monitor_candidates) -> None:
            pass

    Layer._apply = torch.nn.Module._apply  # set from outside, as zero.Init sets _old_init
    Checkpoint._save_topk_checkpoint = ModelCheckpoint._save_topk_checkpoint
    assert _class_violations(Layer) == []
    assert _class_violations(Checkpoint) == ["Checkpoint._save_last_checkpoint overrides a private upstream method"]
