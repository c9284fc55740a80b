"""The package version, alone so that any module can read it without importing the package root."""

__version__ = "0.2.0"
