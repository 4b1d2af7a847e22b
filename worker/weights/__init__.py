"""Where a model's weights come from: a safetensors checkpoint read at disk speed
(`checkpoint`), or a synthetic model built from its catalog config (`synthetic`).
`worker.loading` puts them on the devices of a plan."""
