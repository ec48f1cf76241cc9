"""Fixtures of the planner's tests."""

import jax
import pytest


@pytest.fixture(scope="module")
def no_persistent_cache():
    """Compile-only programs cannot be read back from jax's persistent cache (it warns and compiles again): a module
    compiling for GPU targets turns the cache off (``pytestmark = pytest.mark.usefixtures("no_persistent_cache")``)."""
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", before)
