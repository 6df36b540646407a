"""One module per workflow stage: target, data, regenerate, tokenize, capture, vocab, train, export, acceptance."""
