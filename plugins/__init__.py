"""First-party feature plugins, each registered through the ``nxdplug`` entry-point group."""
