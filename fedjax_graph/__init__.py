"""fedjax-graph: a vectorised JAX simulator for federated graph learning under graph-domain shift."""

__version__ = "0.1.0"
