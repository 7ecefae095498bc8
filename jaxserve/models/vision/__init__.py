"""Vision encoders of vision-language models: pixels -> image embeddings in the text model's
hidden space (clip.py: LLaVA; siglip.py: Gemma 3; vit.py: the ViT pieces they share)."""
