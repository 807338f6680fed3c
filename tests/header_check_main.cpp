// The other translation units of this program each include one public header alone;
// that they compile is the test.
int main() { return 0; }
