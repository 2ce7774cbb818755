"""A placeholder for torchvision in the SGLang test venv (PyPI's torchvision
does not import beside the CPU torch). SGLang's multimodal helpers and
transformers' image utilities import names from it at start-up; the text
models the tests serve never use them."""

from _engine_placeholders import install, placeholder

__version__ = "0.0.0"
install(__name__)


def __getattr__(attr):
    return placeholder(__name__, attr)
