"""The wire APIs, one folder each; an API never imports another."""
