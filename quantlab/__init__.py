"""quantlab: INT8 quantization and accuracy validation for TensorRT deployments."""

from quantlab.errors import (
    BackendUnavailableError,
    ConfigError,
    DataError,
    ModelError,
    OutputExistsError,
    QuantlabError,
)

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "ConfigError",
    "DataError",
    "ModelError",
    "OutputExistsError",
    "QuantlabError",
    "__version__",
]
