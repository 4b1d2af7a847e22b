"""The operator's side: `launcher` (`gpufleet up`: a whole fleet, supervised), `cli`
(the `gpufleet` command line), `metrics` (the Prometheus exporter) and `flower_socket`
(Flower on a socket the launcher bound). May import every other part of `tasks`.
"""
