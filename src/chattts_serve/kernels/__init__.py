"""Kernels and backends any model family may use: the decode-attention op (and its C++ bf16 kernel), packed
linears, the precision modes (bf16, fp16, int8 weights and activations) and their names."""
