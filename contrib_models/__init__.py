"""First-party model plugins, one subpackage per family."""
