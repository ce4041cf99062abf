"""The served version string (ServerMetadata, /v2): its own module so the front ends need not import the package."""

__version__ = "0.1.0"
