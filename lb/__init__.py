"""lb: a regional load balancer for LLM inference (SGLang, vLLM, any OpenAI server)."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("lb")  # the one version: pyproject.toml's, as installed
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
