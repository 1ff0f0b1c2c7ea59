"""Actors: inference engines playing environments, pushing groups to replay."""
