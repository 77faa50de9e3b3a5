"""qkiln.calib_data: calibration and evaluation text -> seeded token sets with a content hash."""

from .sources import TextSource, eval_data_file, load_text_source, portable_spec, read_eval_text, read_text_exact
from .token_set import TokenSet, sample_token_set, token_sha256

__all__ = ["TextSource", "TokenSet", "eval_data_file", "load_text_source", "read_eval_text", "portable_spec", "read_text_exact", "sample_token_set", "token_sha256"]
