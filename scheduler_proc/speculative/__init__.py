"""Speculative decoding (docs/design/speculative.md): proposers draft tokens, one verify pass
of the target model checks them, and each position's token is drawn as plain decoding would
draw it, so the output is the same tokens, only sooner."""
