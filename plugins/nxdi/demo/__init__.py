"""nxdplug's implementation of NxD Inference's ``inference_demo`` (``nxdplug.nxdi.inference_demo``
re-exports it under NxD Inference's names): the command, its flags, the run and the sampling
benchmark. Features add their own flags through ``CliExtension`` records naming
``inference_demo`` (:class:`~nxdplug.nxdi.demo.flags.FeatureDemoFlags`)."""
