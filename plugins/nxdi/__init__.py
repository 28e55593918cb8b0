"""NxD Inference's module layout over nxdplug's own objects.

An NxD Inference script ports by one rename, ``neuronx_distributed_inference`` ->
``nxdplug.nxdi``: ``nxdplug.nxdi.models.config``, ``nxdplug.nxdi.models.llama.modeling_llama``,
``nxdplug.nxdi.utils.hf_adapter``, ... re-export the very objects nxdplug has (no second
implementation). A name NxD Inference has and nxdplug lacks says so:
:class:`~nxdplug.nxdi.reexport.NotProvidedError` from ``from ... import``, its AttributeError
twin otherwise.
"""
