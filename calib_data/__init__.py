"""qkiln.calib_data: calibration and evaluation text -> seeded token sets with a content hash."""

from .sources import TextSource, load_text_source, portable_spec, read_text_exact
from .token_set import TokenSet, sample_token_set, token_sha256

__all__ = ["TextSource", "TokenSet", "load_text_source", "portable_spec", "read_text_exact", "sample_token_set", "token_sha256"]
