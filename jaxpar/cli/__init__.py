"""Command-line tooling around the core, for entry points: nothing here is imported by ``import jaxpar``.

The cli imports the core, never the reverse, so the core stays free of the optional libraries (tyro, tqdm,
tensorboardX, matplotlib) an experiment needs.

* :mod:`jaxpar.cli.experiment`: what every ``experiments/*.py`` script shares: start-up checks
  (``require_extra``), simulated CPU devices, device logging, flat config pieces for tyro (``MeshConfig``,
  ``PrecisionConfig``, ``PruningConfig``), resume checks, and the standard loop hooks (metrics, throughput,
  progress bar).
* :mod:`jaxpar.cli.launch`: ``python -m jaxpar.cli.launch -n 2 script.py ...``, N local processes as one
  multi-process JAX job.

This package imports neither submodule itself (``python -m jaxpar.cli.launch`` then runs the launcher once):
``from jaxpar.cli import experiment``.
"""

__all__ = ["experiment", "launch"]
