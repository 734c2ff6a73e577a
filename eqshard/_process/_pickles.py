"""What JSON cannot carry to a worker or back (a step, abstract arguments, a spec, an
error), as base64 text: `pickled` (by cloudpickle where it is installed, else by
pickle; an Equinox module class that cloudpickle sends by value, a script's, sent as
its class statement, `_module_pickler`: the metaclass called on its fields, then its
methods set, so that it is a pytree of its fields there, where cloudpickle's empty
skeleton registered a pytree of none) and `unpickled`."""

from __future__ import annotations

import base64
import copy
import dataclasses
import functools
import io
import pickle
import sys
import types
import uuid
import weakref
from typing import Any

from .._errors import EqshardError

__all__ = ["pickled", "unpickled"]


def pickled(value: Any, what: str, fix: str) -> str:
    """`value` as base64 text, for a worker's request or answer: pickled by
    cloudpickle where it is installed (which sends functions and classes of `__main__`
    by value, and the rest by name), else by pickle. An Equinox module class that
    cloudpickle sends by value (the user's script's) is rebuilt by its own class
    statement on the other side (`_ModulePickler`), so that it is a pytree of its
    fields there too.

    **Raises:**

    `EqshardError` naming `what` and saying why it cannot be pickled, then `fix`.
    """
    try:
        data = _dumps(value)
    except Exception as error:
        raise EqshardError(
            f"{what} ({type(value).__name__}) cannot cross into another process: pickling "
            f"it raised {type(error).__name__}: {error}; {fix}"
        ) from None
    return base64.b64encode(data).decode("ascii")


def _dumps(value: Any) -> bytes:
    """`value` pickled by `_ModulePickler` where cloudpickle is installed, else by pickle."""
    try:
        import cloudpickle
    except ImportError:
        return pickle.dumps(value)
    with io.BytesIO() as file:
        _module_pickler()(file, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(value)
        return file.getvalue()


# Equinox module classes sent by value: each class's key (made where it was defined,
# kept where it was rebuilt), and the class of each key, so that a class sent twice, or
# sent back, is one class. `_FRESH` holds those rebuilt and not yet given their methods.
_CLASS_KEYS: weakref.WeakKeyDictionary[type, str] = weakref.WeakKeyDictionary()
_CLASSES: weakref.WeakValueDictionary[str, type] = weakref.WeakValueDictionary()
_FRESH: weakref.WeakSet[type] = weakref.WeakSet()

# What a class statement makes of the fields, which the rebuilt class has made again
_MADE_BY_THE_CLASS_STATEMENT = frozenset(
    {
        "__dict__",
        "__weakref__",
        "_abc_impl",
        "__module__",
        "__qualname__",
        "__orig_bases__",
        "__parameters__",
        "__dataclass_params__",
        "__match_args__",
        "__slotnames__",
        "__annotate_func__",
        "__annotate__",
    }
)


@functools.cache
def _module_pickler() -> type:
    """cloudpickle's pickler, but for Equinox module classes it sends by value.

    cloudpickle sends a class of `__main__` by value as a skeleton, `type(name, bases,
    {})` through its metaclass, then its `__dict__` set attribute by attribute.
    Equinox's metaclass makes a class a dataclass and registers it as a pytree, with
    the flattening of its fields, as the class statement runs: given the skeleton's
    empty namespace, it registers a pytree with no fields, which no later attribute
    changes (JAX takes one registration per class). The rebuilt model then flattens
    to no leaves and unflattens to an object without its fields ("'Net' object has
    no attribute 'b'"). Here such a class is sent as its class statement: the
    metaclass called on its fields (their annotations and `dataclasses.Field`s, and
    stand-ins for an `__init__` the class wrote and a `__post_init__`), then its
    methods and other attributes set on the class that statement made
    (`_module_class`, `_set_module_class`).
    """
    import cloudpickle

    class _ModulePickler(cloudpickle.Pickler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.described: set[type] = set()  # pickled once, then found in the memo

        def reducer_override(self, obj: Any) -> Any:
            if obj is dataclasses.MISSING:  # a field's lack of a default: one object
                return getattr, (dataclasses, "MISSING")
            reduced = super().reducer_override(obj)
            equinox = sys.modules.get("equinox")
            if (
                reduced is NotImplemented  # sent by name, or not a class or a function
                or equinox is None
                or not isinstance(obj, type)
                or not issubclass(obj, equinox.Module)
            ):
                return reduced
            if obj in self.described:  # met again while its fields were being pickled
                raise pickle.PicklingError(
                    f"a field of {obj.__qualname__} (its annotation or default) refers to "
                    f"{obj.__qualname__} itself; define the class in a module the worker "
                    "imports by name"
                )
            self.described.add(obj)
            return (
                _module_class,
                _class_statement(obj),
                _class_attributes(obj),
                None,
                None,
                _set_module_class,
            )

    return _ModulePickler


def _class_statement(cls: type) -> tuple[Any, ...]:
    """What `_module_class` calls the metaclass with: the class's own fields, by their
    annotations and `dataclasses.Field`s (which hold their defaults and `eqx.field`'s
    metadata, `static=True` among it); whether the class wrote its own `__init__` (the
    dataclass then made none), and whether it has a `__post_init__` of its own."""
    own = vars(cls).get("__annotations__", {})
    fields = {f.name: f for f in dataclasses.fields(cls)}  # pyright: ignore[reportArgumentType]
    namespace: dict[str, Any] = {
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__annotations__": {name: own[name] for name in own if name in fields},
    }
    for name in namespace["__annotations__"]:
        namespace[name] = copy.copy(fields[name])
    key = _CLASS_KEYS.get(cls)
    if key is None:
        key = _CLASS_KEYS[cls] = uuid.uuid4().hex
        _CLASSES[key] = cls
    bases = tuple(vars(cls).get("__orig_bases__", cls.__bases__))
    stand_ins = ("__init__" if _wrote_init(cls) else "__post_init__",)
    stand_ins = tuple(name for name in stand_ins if name in vars(cls))
    return (type(cls), cls.__name__, bases, namespace, stand_ins, key)


def _wrote_init(cls: type) -> bool:
    """Whether `cls` has an `__init__` of its own that the dataclass did not make."""
    made = getattr(vars(cls).get("__dataclass_params__"), "init", False)
    return "__init__" in vars(cls) and not made


def _class_attributes(cls: type) -> dict[str, Any]:
    """What `_set_module_class` sets on the class the statement made: its methods and
    every other attribute of its own (its annotations and fields whole), but those
    the statement made again (a dataclass's `__init__` among them)."""
    slots = vars(cls).get("__slots__", ())
    made = _MADE_BY_THE_CLASS_STATEMENT | set([slots] if isinstance(slots, str) else slots)
    if not _wrote_init(cls):
        made |= {"__init__"}
    return {name: value for name, value in vars(cls).items() if name not in made}


def _module_class(
    metaclass: type,
    name: str,
    bases: tuple[Any, ...],
    namespace: dict[str, Any],
    stand_ins: tuple[str, ...],
    key: str,
) -> type:
    """The class `_class_statement` describes, made by its metaclass from its fields
    (the dataclass and the pytree registered with them), or the one already here for
    its key (defined in this process, or rebuilt before)."""
    found = _CLASSES.get(key)
    if found is not None:
        return found

    def stand_in(self: Any, *args: Any, **kwargs: Any) -> None:
        raise TypeError(f"{name} is being rebuilt by eqshard: its own methods come next")

    body = {**namespace, **dict.fromkeys(stand_ins, stand_in)}
    cls = types.new_class(name, bases, {"metaclass": metaclass}, lambda ns: ns.update(body))
    _CLASS_KEYS[cls] = key
    _CLASSES[key] = cls
    _FRESH.add(cls)
    return cls


def _set_module_class(cls: type, attributes: dict[str, Any]) -> type:
    """The rest of a class `_module_class` rebuilt: its methods and other attributes
    (a class found here, not rebuilt, is left as it is)."""
    if cls in _FRESH:
        _FRESH.discard(cls)
        for name, value in attributes.items():
            setattr(cls, name, value)
    return cls


def unpickled(text: str, what: str) -> Any:
    """What `pickled` wrote, read back (in a worker, with its parent's `sys.path`).

    **Raises:**

    `EqshardError` naming `what`, when it cannot be read here (a module it names
    by name cannot be imported).
    """
    try:
        return pickle.loads(base64.b64decode(text))  # the parent pickled it
    except Exception as error:
        raise EqshardError(
            f"{what} cannot be read in another process: unpickling it raised "
            f"{type(error).__name__}: {error}; what it names must be importable by name "
            "with the parent's `sys.path`"
        ) from None
