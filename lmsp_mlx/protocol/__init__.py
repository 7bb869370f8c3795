"""Wire types: requests, items, response objects, stream events and problem documents."""
