"""The one error shape of the planning core: a message that starts with the field it is about."""

from __future__ import annotations


class FieldError(ValueError):
    """`field: message`; `field` names the setting, key or argument to change. Picklable, so it crosses Ray actors
    as itself."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message

    def __reduce__(self):
        return (type(self), (self.field, self.message))
