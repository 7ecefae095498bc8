"""Image inputs' configuration: vLLM's --limit-mm-per-prompt, --allowed-local-media-path and
--allowed-media-domains."""

from __future__ import annotations

import dataclasses
import os

from jaxserve.config.json_flag import json_object

# The modalities jaxserve takes, and vLLM's others, which a limit may only turn off (0).
MODALITIES = ("image",)
UNSUPPORTED_MODALITIES = ("video", "audio")
DEFAULT_LIMIT_PER_PROMPT = 999  # vLLM's, per modality, when --limit-mm-per-prompt leaves it out


@dataclasses.dataclass(frozen=True)
class MultiModalConfig:
    """limit_per_prompt: the most items of each modality one prompt may carry ({"image": N};
    a model that takes no images takes 0 whatever it says); allowed_local_media_path: the
    directory (absolute) whose files a request may name as file:// URLs (None: no local
    files); allowed_media_domains: the host names (lower case) http(s) image URLs may name,
    on every redirect hop (None: any). Read by the frontend only: not part of what the
    compiled steps depend on."""

    limit_per_prompt: dict[str, int] = dataclasses.field(
        default_factory=lambda: {m: DEFAULT_LIMIT_PER_PROMPT for m in MODALITIES}
    )
    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for modality, limit in self.limit_per_prompt.items():
            if modality not in MODALITIES + UNSUPPORTED_MODALITIES:
                raise ValueError(
                    f"limit_mm_per_prompt: unknown modality {modality!r}; jaxserve takes "
                    f"{', '.join(MODALITIES)}"
                )
            if type(limit) is not int or limit < 0:
                raise ValueError(
                    f"limit_mm_per_prompt[{modality!r}] must be a non-negative integer, "
                    f"got {limit!r}"
                )
            if modality in UNSUPPORTED_MODALITIES and limit:
                raise ValueError(
                    f"limit_mm_per_prompt[{modality!r}] = {limit}: jaxserve takes no {modality} "
                    f"inputs (only {', '.join(MODALITIES)}); leave it out or set it to 0"
                )

    def limit(self, modality: str) -> int:
        """The most `modality` items one prompt may carry."""
        return self.limit_per_prompt.get(modality, DEFAULT_LIMIT_PER_PROMPT)

    @classmethod
    def parse(
        cls,
        limit_mm_per_prompt: dict | str | None,
        allowed_local_media_path: str | None,
        allowed_media_domains: list[str] | tuple[str, ...] | None = None,
    ) -> MultiModalConfig:
        """From EngineArgs' values: the limits as a dict or its JSON (vLLM's {"image": N}, or
        {"image": {"count": N, ...}} whose other keys size vLLM's memory profiling and are
        ignored here), over the defaults; the media path an existing directory; the media
        domains host names (no scheme, port or path)."""
        limits = json_object(limit_mm_per_prompt, "limit_mm_per_prompt")
        limits = {k: v.get("count", v) if isinstance(v, dict) else v for k, v in limits.items()}
        path = allowed_local_media_path
        if path is not None:
            path = os.path.realpath(os.path.expanduser(path))
            if not os.path.isdir(path):
                what = "is not a directory" if os.path.exists(path) else "does not exist"
                raise ValueError(f"allowed_local_media_path {allowed_local_media_path!r} {what}")
        defaults = {m: DEFAULT_LIMIT_PER_PROMPT for m in MODALITIES}
        return cls({**defaults, **limits}, path, _host_names(allowed_media_domains))


def _host_names(domains: list[str] | tuple[str, ...] | None) -> tuple[str, ...] | None:
    """--allowed-media-domains as lower-case host names; ValueError naming an entry that is
    not one (a URL, a host with a port, an empty string). None or empty: any host (vLLM's)."""
    if not domains:
        return None
    if isinstance(domains, str) or not all(isinstance(d, str) for d in domains):
        raise ValueError(f"allowed_media_domains must be a list of host names, got {domains!r}")
    for d in domains:
        if not d.strip(".") or any(c in d for c in "/:@?#[] \t"):
            raise ValueError(
                f"allowed_media_domains: {d!r} is not a host name (e.g. upload.wikimedia.org: "
                "no scheme, port or path)"
            )
    return tuple(d.lower().rstrip(".") for d in domains)
