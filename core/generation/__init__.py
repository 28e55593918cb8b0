"""HF transformers' ``generate()`` over an application, run through the serving engine when a
request needs it, and the accuracy checks against HF: the layer above the engine."""
