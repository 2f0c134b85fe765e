"""Model layer: loading weights and tokenizers, the Transformer forward pass, and the ModelRunner."""
