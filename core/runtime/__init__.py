"""The runtime: applications, sub-models, the step record, generation and speculation."""
