"""Hugging Face checkpoints as the pipeline's units: `config` reads a checkpoint directory's
`config.json` into an `HFArchitecture`, `units` builds a family's units (`embed`, `blocks.<i>`,
`head`) from the `transformers` classes under the checkpoint's own parameter names, and `load`
materialises only the named units from the checkpoint's safetensors file(s)."""
