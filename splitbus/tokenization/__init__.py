"""Tokenizers of served models: used by the API (encode, chat templates) and by workers
(incremental decoding). Imports no other splitbus part."""

from splitbus.tokenization.chat_template import ChatTemplateError, ChatTemplateLimit
from splitbus.tokenization.tokenizer import ModelFilesError, ModelTokenizer

__all__ = ["ChatTemplateError", "ChatTemplateLimit", "ModelFilesError", "ModelTokenizer"]
