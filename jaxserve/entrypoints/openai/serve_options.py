"""ServeOptions: the `jaxserve serve` flags that change what the API answers (vLLM's frontend
flags of the same names), one frozen value the app and every serving class share, so a feature
reads `self.options.X` instead of growing a keyword argument in each constructor."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    # Every streamed chunk carries `usage` (null until the last), as if each request asked
    # for stream_options.include_usage (--enable-force-include-usage)
    enable_force_include_usage: bool = False
    # Logprobs name tokens as "token_id:N" instead of their text (--return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool = False
    # GET /load answers the number of requests in flight; responses carry the ORCA
    # endpoint-load-metrics header when asked (--enable-server-load-tracking)
    enable_server_load_tracking: bool = False
    # GET /tokenizer_info answers the tokenizer's configuration (--enable-tokenizer-info-endpoint)
    enable_tokenizer_info_endpoint: bool = False
    # Chat template arguments under each request's chat_template_kwargs
    # (--default-chat-template-kwargs)
    default_chat_template_kwargs: dict | None = None
    # The prefix a proxy strips before forwarding (--root-path): routes answer under it too
    root_path: str = ""

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
