"""The version, readable without importing anything else (renderers write it into results)."""

__version__ = "0.1.0"
