"""URL slugs."""


def slugify(text):
    """Lowercase words joined by single hyphens; only letters and digits are kept."""
    return text.lower().replace(" ", "-")
