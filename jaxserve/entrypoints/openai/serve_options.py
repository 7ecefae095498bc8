"""ServeOptions: the `jaxserve serve` flags that change what the API answers (vLLM's frontend
flags of the same names), one frozen value the app and every serving class share, so a feature
reads `self.options.X` instead of growing a keyword argument in each constructor."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    # Every streamed chunk carries `usage` (the counts so far), then a usage chunk, as if each
    # request asked for stream_options' include_usage and continuous_usage_stats (vLLM's
    # --enable-force-include-usage)
    enable_force_include_usage: bool = False
    # Logprobs name tokens as "token_id:N" instead of their text (--return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool = False
    # GET /load counts the requests in flight, else answers 0 (--enable-server-load-tracking;
    # load_tracking.py: the ORCA header is answered either way, as vLLM's)
    enable_server_load_tracking: bool = False
    # GET /tokenizer_info answers the tokenizer's configuration (--enable-tokenizer-info-endpoint)
    enable_tokenizer_info_endpoint: bool = False
    # Chat template arguments under each request's chat_template_kwargs
    # (--default-chat-template-kwargs)
    default_chat_template_kwargs: dict | None = None
    # The prefix a proxy strips before forwarding (--root-path): routes answer under it too
    root_path: str = ""
    # The model as the user named it (serve's model argument: a hub id, a path), /v1/models'
    # root; None: the bundled default's hub name, or the model's path
    model: str | None = None

    @classmethod
    def from_args(cls, args) -> ServeOptions:
        """The options from parsed `jaxserve serve` flags (absent ones at their defaults)."""
        return cls(
            **{
                f.name: getattr(args, f.name)
                for f in dataclasses.fields(cls)
                if getattr(args, f.name, None) is not None
            }
        )
