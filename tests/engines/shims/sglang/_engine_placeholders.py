"""Placeholder modules for packages the SGLang test venv cannot install
(torchvision, sgl_kernel): every submodule imports, every name is a
placeholder class whose attributes are placeholders too, and which raises
when it is called. What the tests serve never calls one."""

import importlib.abc
import importlib.machinery
import sys
import types


class _Meta(type):
    def __getattr__(cls, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return placeholder(f"{cls.__module__}.{cls.__name__}", attr)

    def __call__(cls, *args, **kwargs):
        raise NotImplementedError(
            f"{cls.__module__}.{cls.__name__} is a placeholder in " "this test venv"
        )


def placeholder(module_name: str, attr: str):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _Meta(attr, (), {"__module__": module_name})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, package: str):
        self.package = package

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(self.package + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda attr, _n=spec.name: placeholder(_n, attr)
        return module

    def exec_module(self, module):
        pass


def install(package: str) -> None:
    """Every `package.x.y` imports as a placeholder module."""
    sys.meta_path.append(_Finder(package))
