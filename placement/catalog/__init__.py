"""The model catalog (`catalog`: the YAML file of the models a fleet may serve) and
`estimate` (a model's bytes from its transformers config, read lazily).

Imports `placement.rules`, `placement.policy`, `placement.units` and `placement.errors`.
"""
