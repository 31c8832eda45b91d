"""The router's matching of MLServer's custom REST paths (Starlette's templates)."""

from __future__ import annotations

import pytest

from poolserve.service.router.custom_routes import compile_path


@pytest.mark.parametrize(
    ("template", "path", "matches"),
    [
        ("/invocations", "/invocations", True),
        ("/invocations", "/invocations/", False),
        ("/invocations", "/invocationsX", False),
        ("/a.b", "/aXb", False),  # a dot is a dot
        ("/hooks/{item}", "/hooks/ab", True),
        ("/hooks/{item}", "/hooks/a/b", False),  # one segment
        ("/hooks/{item}", "/hooks/", False),
        ("/files/{rest:path}", "/files/a/b/c", True),
        ("/n/{k:int}", "/n/12", True),
        ("/n/{k:int}", "/n/x", False),
        ("/f/{x:float}", "/f/1.5", True),
        ("/m/{a}/x/{b}", "/m/1/x/2", True),
    ],
)
def test_templates_match_as_starlette(template: str, path: str, matches: bool) -> None:
    assert (compile_path(template).match(path) is not None) is matches
