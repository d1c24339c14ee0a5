"""The server's log: followed by offset and inode as tail -F does, and its markers read."""
