"""Every annotation in kvlab resolves: jaxtyping shapes and names are real objects."""

import importlib
import inspect
import pkgutil
import typing

import kvlab


def annotated_objects():
    """Every class, function and method defined in a kvlab module."""
    for info in pkgutil.walk_packages(kvlab.__path__, "kvlab."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(obj) or inspect.isclass(obj):
                yield f"{info.name}.{name}", obj
            if inspect.isclass(obj):
                for attribute, member in vars(obj).items():
                    if inspect.isfunction(member):
                        yield f"{info.name}.{name}.{attribute}", member


def test_every_annotation_resolves():
    unresolved = []
    for name, obj in annotated_objects():
        try:
            typing.get_type_hints(obj)
        except Exception as error:  # noqa: BLE001 - the test reports every kind of failure
            unresolved.append(f"{name}: {error!r}")
    assert not unresolved, "\n".join(unresolved)
    assert typing.get_type_hints(kvlab.Cache)["lengths"] is not None
