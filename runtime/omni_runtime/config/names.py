"""Kubernetes' rules for names, which stage names, namespaces, Service names and the
operator's objects obey: defined once, for the schema, the router and the CRD's CEL."""

from __future__ import annotations

import re

# The most characters of a label (and of a Service's or a namespace's name).
MAX_DNS_LABEL = 63
# RFC 1123: what namespaces are, and label values such as a stage's name; JSON Schema's and
# CEL's form (anchored).
DNS_LABEL_PATTERN = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# RFC 1035: a Service's name, which must start with a letter.
DNS_1035_LABEL_PATTERN = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
_DNS_LABEL = re.compile(DNS_LABEL_PATTERN)
_DNS_1035_LABEL = re.compile(DNS_1035_LABEL_PATTERN)


def is_dns_label(value: str) -> bool:
    """Whether ``value`` is an RFC 1123 label: at most 63 lower-case letters, digits and
    '-', starting and ending with a letter or digit."""
    return len(value) <= MAX_DNS_LABEL and _DNS_LABEL.match(value) is not None


def is_dns_1035_label(value: str) -> bool:
    """Whether ``value`` is an RFC 1035 label: an RFC 1123 one that starts with a letter."""
    return len(value) <= MAX_DNS_LABEL and _DNS_1035_LABEL.match(value) is not None
