"""Stand-ins for a library the script imports later: set when its module is imported, taken back on exit.

The fake GPU enters before the script runs, when most libraries it will
use are not imported yet, and importing them all up front would cost every
preflight the time of libraries the script never uses. A stand-in for such
a library (bitsandbytes' paged buffers) waits for its module instead: a
finder on ``sys.meta_path`` sees the import, lets it run, then sets the
stand-ins on the module; if the module is imported already they are set at
once. Removing the hook takes the finder away and puts the module's own
attributes back.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

#: What a library's stand-ins are made from: its module, given once imported;
#: it returns the (owner, name, value) triples to set: on the module itself,
#: or on a class it defines (a method of its base model class).
MakeStandIns = Callable[[ModuleType], Sequence[tuple[Any, str, Any]]]


@contextlib.contextmanager
def replaced(owner: Any, attributes: dict[str, Any]) -> Iterator[None]:
    """Sets ``attributes`` on ``owner`` for the block, and puts the old values back after.

    Only what the owner held itself is put back; a name it had from a base
    class (``UntypedStorage.resize_``, a C method of its base) or not at
    all is deleted again, so that the class is left as it was.
    """
    missing = object()
    own = getattr(owner, "__dict__", {})
    old = {name: own.get(name, missing) for name in attributes}
    for name, value in attributes.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is missing:
                with contextlib.suppress(AttributeError):
                    delattr(owner, name)
            else:
                setattr(owner, name, value)


class _Setter:
    """The stand-ins for one module: set once, and the module's own attributes put back on removal."""

    def __init__(self, module_name: str, make: MakeStandIns) -> None:
        self.module_name = module_name
        self.make = make
        self._set: contextlib.ExitStack | None = None

    def set_on(self, module: ModuleType) -> None:
        if self._set is not None:
            return
        self._set = contextlib.ExitStack()
        for owner, name, value in self.make(module):
            self._set.enter_context(replaced(owner, {name: value}))

    def take_back(self) -> None:
        done, self._set = self._set, None
        if done is not None:
            done.close()


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for the one module it waits for, it wraps the real loader so
    that the stand-ins are set as soon as the module's code has run."""

    def __init__(self, setter: _Setter) -> None:
        self.setter = setter

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.setter.module_name:
            return None
        # The finders that find modules find it (this one is first on the path); the others of
        # this kind find nothing, and those waiting for the same module have their stand-ins set
        # with these (asked to find it, each would ask the other again, without end).
        setters = [self.setter]
        for finder in sys.meta_path:
            if isinstance(finder, _Finder):
                if finder is not self and finder.setter.module_name == fullname:
                    setters.append(finder.setter)
                continue
            if not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, setters)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    """The real loader, and then the stand-ins of each hook waiting for it set on the module it made."""

    def __init__(self, loader: Any, setters: list[_Setter]) -> None:
        self.loader = loader
        self.setters = setters

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        for setter in self.setters:
            setter.set_on(module)

    def __getattr__(self, name: str) -> Any:
        # What else the real loader offers (get_source, is_package: tracebacks and pkgutil read them).
        return getattr(self.loader, name)


class _Handle:
    """What registering returns: ``remove()`` takes the finder away and the stand-ins back."""

    def __init__(self, finder: _Finder) -> None:
        self.finder = finder

    def remove(self) -> None:
        if self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)
        self.finder.setter.take_back()


def when_imported(module_name: str) -> Callable[[MakeStandIns], _Handle]:
    """A hook's registration for the fake GPU's ledger: the stand-ins ``make`` returns are set
    on ``module_name`` when it is imported (at once, if it is), and taken back on removal."""

    def register(make: MakeStandIns) -> _Handle:
        setter = _Setter(module_name, make)
        finder = _Finder(setter)
        module = sys.modules.get(module_name)
        if module is not None:
            setter.set_on(module)
        else:
            sys.meta_path.insert(0, finder)
        return _Handle(finder)

    return register
