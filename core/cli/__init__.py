"""The ``nxdplug`` command."""
