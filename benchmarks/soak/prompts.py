"""What the soak's clients ask: short and medium prompts, and the tool of the tool loop."""

SHORT_PROMPTS = [
    "What is the capital of France?", "Say hello in three languages.", "Name three primary colours.",
    "What is 17 times 23?", "Write a haiku about the sea.", "Give me a synonym for happy.",
    "Why is the sky blue? One sentence.", "List four planets.", "What does a compiler do?",
    "Tell me a short joke about cats.", "How many legs does a spider have?", "Translate 'good morning' to Spanish.",
]
NOTES = [
    "The committee met on Tuesday to review the harbour renovation plan.",
    "Costs rose by twelve percent because steel prices climbed over the winter.",
    "The north pier will close for six weeks starting in early spring.",
    "Fishing boats will be moved to the temporary moorings near the lighthouse.",
    "A new ferry schedule will run every forty minutes during the works.",
    "Local shops asked for extra parking spaces along the promenade.",
    "The engineers found that the old timber pilings were weaker than expected.",
    "Divers will inspect the seawall before any heavy machinery arrives.",
    "The town council approved a grant to cover half of the additional costs.",
    "Residents complained about noise from night shifts at the boatyard.",
    "A public meeting is planned for the first Monday of next month.",
    "The museum will host an exhibition about the history of the harbour.",
    "Storm damage last autumn destroyed part of the breakwater.",
    "Contractors expect the dredging to take about three weeks.",
    "The sailing club will move its races to the bay until the summer.",
    "Water quality tests will be published every week on the council website.",
    "A second crane will be hired if the schedule slips further.",
    "The harbour master wants new lights installed on the outer wall.",
    "Tourist numbers are expected to fall slightly during the closure.",
    "The final report will be presented to the council in June.",
]
ASKS = ["Summarize the notes above in two sentences.", "What are the three main risks in these notes?",
        "Write a short email to residents based on these notes.", "List the dates and durations mentioned."]
CITIES = ["Paris", "Hangzhou", "Oslo", "Lima", "Nairobi", "Toronto", "Kyoto", "Lisbon", "Cairo", "Perth"]
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
