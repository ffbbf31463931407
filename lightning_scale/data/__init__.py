from lightning_scale.data.corpus import RandomTokens, TokenWindows, split, stdlib_corpus

__all__ = ["RandomTokens", "TokenWindows", "split", "stdlib_corpus"]
