"""Errors quantlab raises at its boundaries (CLI, config, data loaders, model loading).

Every message names the file, tensor or field at fault and says what to do.
"""


class QuantlabError(Exception):
    """Base class of every error quantlab reports to a user."""


class ModelError(QuantlabError):
    """A model file is missing, is not ONNX, is corrupt or uses something unsupported."""


class InternalRunError(ModelError):
    """ONNX Runtime failed on a model quantlab cut out of the user's (a segment, a layer),
    fed tensors quantlab computed; the caller says whether the data or the cut is at fault."""


class DataError(QuantlabError):
    """Input data is missing, empty, undecodable, of the wrong shape, or holds NaN/Inf."""


class ConfigError(QuantlabError):
    """A command-line option or configuration field has a value that cannot work."""


class OutputExistsError(QuantlabError):
    """The output folder already holds results and overwriting was not requested."""


class BackendUnavailableError(QuantlabError):
    """A backend's runtime (e.g. tensorrt) is not installed on this machine."""
