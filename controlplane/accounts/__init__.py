"""Users, roles (viewer, operator, admin) and the permission every API view uses."""
