// VccStack example (placeholder until VCC lands).
int main() { return 0; }
